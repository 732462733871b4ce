# Sourced by the device-call scripts: the carried pure-Python wheels (.carry/node/*/, .carry/fp8/ where carried)
# unzipped to /tmp/pylib and put on the path (a wheel is a zip: no pip, no network on the device machine);
# unbuffered Python output, $OUT defaulted, and `gpu_tests SECONDS FILE...` (tests/gpu/ files without the
# shared conftest, which imports the settings: its last lines).
python3 -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('/tmp/pylib') for w in glob.glob('.carry/node/*/*.whl') + glob.glob('.carry/fp8/*.whl')]"
export PYTHONPATH=/tmp/pylib PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
gpu_tests() {
  local seconds=$1; shift
  timeout "$seconds" python3 -m pytest -o addopts="" --noconftest -q -p no:cacheprovider "$@" 2>&1 | tail -3
}
