"""`python -m dsc ...` (and `torchrun -m dsc generate ...`)."""

from dsc.cli import main

main()
