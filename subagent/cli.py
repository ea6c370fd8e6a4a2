"""The `subagent` command line.

Only `demo` exists so far, as a placeholder that says so; the ACP provider issue replaces it with a
real turn against the bundled stub agent.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the command line and return its exit status."""
    parser = argparse.ArgumentParser(prog="subagent", description="Delegate work to another agent.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="run a turn against the bundled stub agent (placeholder for now)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        print(
            "subagent demo: placeholder. The seam core is installed; the demo turn against the bundled "
            "stub ACP agent arrives with the ACP provider.",
        )
        return 0
    return 2  # pragma: no cover - argparse rejects unknown commands first


if __name__ == "__main__":
    sys.exit(main())
