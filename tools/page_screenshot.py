"""A screenshot of the browser page mid-stream (``docs/plots/page.png``).

``python -m tools.page_screenshot [--url URL] [--out FILE] [--tokens N]`` drives
Debian's headless Chromium (``apt-get install -y chromium chromium-driver``; selenium
from the test extra, which downloads nothing here: both paths are given) against a
running server: it types a prompt, presses Start, waits until the page shows N tokens,
saves the screenshot, and presses Stop (the request is cancelled on the server).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# Headless, and none of the background connections a closed network refuses.
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
)
PROMPT = "The sky appears blue during the day because"
POLL_S = 0.05  # between looks at the page's token count
WAIT_S = 120.0  # a safety net: a CPU under load can be slow


@contextmanager
def headless_chromium(*extra_flags: str) -> Iterator[webdriver.Chrome]:
    """Debian's Chromium through its chromedriver, headless, in a fresh profile; both paths
    are given, so selenium's manager downloads nothing."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, *extra_flags):
        options.add_argument(flag)
    with tempfile.TemporaryDirectory(prefix="streamscope-chromium-") as profile:
        options.add_argument(f"--user-data-dir={profile}")
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER),
                                  options=options)
        try:
            yield driver
        finally:
            driver.quit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/")
    parser.add_argument("--out", default="docs/plots/page.png")
    parser.add_argument("--tokens", type=int, default=30, help="shown when the shot is taken")
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    with headless_chromium("--hide-scrollbars", "--window-size=820,720") as driver:
        driver.get(args.url)
        driver.execute_script(
            "document.getElementById('prompt').value = arguments[0];"
            "document.getElementById('max-tokens').value = String(arguments[1]);",
            PROMPT, args.max_tokens)
        driver.find_element("id", "start").click()
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and int(driver.execute_script(
                "return document.getElementById('tokens').textContent")) < args.tokens:
            time.sleep(POLL_S)
        driver.save_screenshot(args.out)
        driver.find_element("id", "stop").click()
        deadline = time.monotonic() + WAIT_S  # the DELETE goes out before quit()
        while time.monotonic() < deadline and not str(driver.execute_script(
                "return document.getElementById('status').textContent")).startswith("stopped"):
            time.sleep(POLL_S)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
