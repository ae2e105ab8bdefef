"""The `dflash` command line."""

from __future__ import annotations

import argparse
import sys


def _selfcheck(args: argparse.Namespace) -> int:
    from . import selfcheck

    return 0 if selfcheck.run() else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("selfcheck", help="compare every op's implementation with the reference")
    p.set_defaults(func=_selfcheck)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
