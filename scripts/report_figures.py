"""Open a kvprof dashboard in headless Chromium, check it, and export its figures as PNG.

    python scripts/report_figures.py REPORT.html OUT_DIR

Fails (exit 1) when the page logs a console error or a figure is not drawn. Writes OUT_DIR/fig-<i>.png for every
figure and OUT_DIR/decision.png for the page's first section (the decision, on a dashboard with a replay). Needs a
system Chromium and playwright (`pip install -e '.[browser]'`); see kvprof/report/browser.py. The README's
docs/img/decision.png is OUT_DIR/fig-0.png of the full demo's runs/demo-full/report.html.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from kvprof.errors import KvprofError
from kvprof.report.browser import open_page


def main(page: Path, out: Path) -> int:
    if not page.is_file():
        raise KvprofError(
            f"report {page} does not exist; pass an HTML page written by `kvprof report` or `kvprof demo`."
        )
    count = len(set(re.findall(r'<div id="(fig-\d+)"', page.read_text(encoding="utf-8"))))
    shots = {"section": out / "decision.png"} | {f"#fig-{i}": out / f"fig-{i}.png" for i in range(count)}
    check = open_page(page, shots)
    print(f"{len(check.figures)} figures, {len(check.undrawn)} not drawn, {len(check.errors)} console errors")
    for error in check.errors:
        print(f"console error: {error}")
    if check.undrawn:
        print(f"not drawn: {', '.join(check.undrawn)}")
    print(f"wrote {len(shots)} PNG files to {out}")
    return 1 if check.errors or check.undrawn or len(check.figures) != count else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    try:
        sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
    except KvprofError as err:
        sys.exit(str(err))
