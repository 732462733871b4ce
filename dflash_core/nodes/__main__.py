"""`python -m dflash_core.nodes provision --local ...`: the node commands without the `dflash` entry point."""

from dflash_core.nodes.cli import main

main()
