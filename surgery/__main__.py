"""``python -m surgery``: the Hydra application in :mod:`surgery.cli.app`."""

from surgery.cli.app import main

if __name__ == "__main__":
    main()
