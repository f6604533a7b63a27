"""``python -m blockflow``: the blockflow command line (see :mod:`blockflow.cli`)."""

from blockflow.cli import main

if __name__ == "__main__":
    main()
