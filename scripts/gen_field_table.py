"""Write docs/server.md's field table from ``latentserve.server.fields`` (the one
declaration of each route's implemented, accepted and refused fields).

    python scripts/gen_field_table.py          # rewrite the table in docs/server.md
    python scripts/gen_field_table.py --check  # exit 1 if the table is out of date
"""

import argparse
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "server.md"


def main() -> int:
    from latentserve.server.fields import with_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if stale")
    args = parser.parse_args()
    doc = DOC.read_text(encoding="utf-8")
    new = with_table(doc)
    if args.check:
        if new != doc:
            print(f"{DOC} field table is out of date: run scripts/gen_field_table.py")
            return 1
        return 0
    DOC.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
