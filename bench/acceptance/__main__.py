"""`python -m bench.acceptance prepare|run|report|curve [...]`: `curve` is curve.py's command line, the rest
run.py's (run is the default action)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["curve"]:
        from .curve import main as curve_main

        curve_main(argv[1:])
    else:
        from .run import main as run_main

        run_main(argv)


if __name__ == "__main__":
    main()
