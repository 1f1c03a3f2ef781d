"""``python -m peak.compat install|uninstall|status [--site-dir DIR]``: the Apex alias for every
interpreter of this environment (see peak.compat)."""
from __future__ import annotations

import argparse
import os
import sys

from . import RealApexError, _finder, install_pth, pth_paths, uninstall_pth


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m peak.compat",
        description="Make `import apex` / `amp_C` / `apex_C` resolve to peak in this environment.")
    parser.add_argument("command", choices=["install", "uninstall", "status"])
    parser.add_argument("--site-dir", default=None, help="where to write the .pth file "
                        "(default: this environment's site-packages)")
    args = parser.parse_args(argv)
    if args.command == "install":
        try:
            pth = install_pth(args.site_dir)
        except RealApexError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"peak's Apex alias installed: {pth}\n"
              "`import apex` now resolves to peak in new interpreters of this environment; "
              "`python -m peak.compat uninstall` removes it.")
    elif args.command == "uninstall":
        removed = uninstall_pth(args.site_dir)
        print("removed: " + ", ".join(removed) if removed
              else "peak's Apex alias was not installed")
    else:
        pth, _ = pth_paths(args.site_dir)
        print(f"alias .pth: {'installed at ' + pth if os.path.exists(pth) else 'not installed'}")
        for name in _finder.TOP_NAMES:  # (a real one of any of them keeps the alias off)
            print(f"real {name}: {_finder.real_apex_location(name) or 'not importable'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
