"""Debian's headless Chromium for the browser tests (selenium, which downloads nothing here:
both paths are given; ``.ci/run`` installs ``chromium`` and ``chromium-driver``)."""

from __future__ import annotations

import tempfile
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
