# Sourced by the device-call scripts: the carried pure-Python wheels (.carry/node/*/, .carry/fp8/ where carried)
# unzipped to /tmp/pylib and put on the path (a wheel is a zip: no pip, no network on the device machine).
python3 -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('/tmp/pylib') for w in glob.glob('.carry/node/*/*.whl') + glob.glob('.carry/fp8/*.whl')]"
export PYTHONPATH=/tmp/pylib
