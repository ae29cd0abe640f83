"""A dashboard opened in headless system Chromium (`KVPROF_CHROMIUM` overrides) through playwright: console errors,
figures drawn, element screenshots as static PNG export (no kaleido; docs/commands/report.md).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from kvprof.errors import KvprofError

# Per plotly div on the page: its id, whether plotly drew it (an SVG with at least one trace or heatmap image) and
# how many traces its data holds.
FIGURES_JS = """() => Array.from(document.querySelectorAll('div[id^="fig-"]')).map(el => ({
  id: el.id,
  drawn: el.classList.contains('js-plotly-plot') && !!el.querySelector('.main-svg')
    && el.querySelectorAll('g.trace, g.hm, image').length > 0,
  traces: (el.data || []).length,
}))"""


DRAWN_JS = (
    """() => Array.from(document.querySelectorAll('div[id^="fig-"]')).every(el => el.querySelector('.main-svg'))"""
)


@dataclass
class PageCheck:
    """What the browser saw: console errors and uncaught exceptions, and each figure's state."""

    errors: list[str] = field(default_factory=list)
    figures: list[dict] = field(default_factory=list)

    def on_console(self, message) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def on_error(self, error) -> None:
        self.errors.append(str(error))

    @property
    def undrawn(self) -> list[str]:
        return [figure["id"] for figure in self.figures if not figure["drawn"] or not figure["traces"]]


def chromium_path() -> str | None:
    """The Chromium executable to drive, or None when none is installed."""
    named = os.environ.get("KVPROF_CHROMIUM")
    if named:
        return named if Path(named).is_file() else None
    return next((found for name in ("chromium", "chromium-browser") if (found := shutil.which(name))), None)


def open_page(
    page_path: Path,
    screenshots: dict[str, Path] | None = None,
    width: int = 1280,
    scale: float = 1.0,
    timeout_ms: int = 20_000,
) -> PageCheck:
    """Open `page_path`, wait up to `timeout_ms` until plotly drew every figure, check it; `screenshots`: CSS selector
    → PNG of its first element."""
    executable = chromium_path()
    try:
        from playwright.sync_api import TimeoutError as PlaywrightTimeout
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise KvprofError("opening a report in a browser needs playwright; run `pip install playwright`.") from None
    if executable is None:
        raise KvprofError("no Chromium found; install one (`apt-get install chromium`) or name it in KVPROF_CHROMIUM.")
    check = PageCheck()
    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": width, "height": 900}, device_scale_factor=scale)
            page.on("console", check.on_console)
            page.on("pageerror", check.on_error)
            page.goto(Path(page_path).resolve().as_uri(), wait_until="load")
            try:  # plotly may finish drawing after the load event
                page.wait_for_function(DRAWN_JS, timeout=timeout_ms)
            except PlaywrightTimeout:
                pass  # what is not drawn by then is reported as undrawn
            check.figures = page.evaluate(FIGURES_JS)
            for selector, target in (screenshots or {}).items():
                Path(target).parent.mkdir(parents=True, exist_ok=True)
                page.locator(selector).first.screenshot(path=str(target))
        finally:
            browser.close()
    return check
