"""``python -m kvserve``: the same as the ``kvserve`` command."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
