"""Alias kept for ``verl-prefix`` launchers installed before the layout change (``verl_prefix.cli:main``)
and for ``python -m verl_prefix.cli``."""

from verl_prefix.tools.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
