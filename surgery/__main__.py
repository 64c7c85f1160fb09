"""``python -m surgery``: the Hydra application in :mod:`surgery.cli.app`."""

import sys

try:
    from surgery.cli.app import main
except ModuleNotFoundError as err:  # the library is installed without the app's extra
    if err.name and err.name.split(".")[0] in {"hydra", "omegaconf", "matplotlib", "sklearn", "yaml"}:
        sys.exit(f"surgery: error: the command line needs {err.name!r}; install it with: pip install 'surgery[cli]'")
    raise

if __name__ == "__main__":
    main()
