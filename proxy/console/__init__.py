"""The operator console at `/console/`: a page and a JSON API to see and cancel tasks (README "Console")."""

from proxy.console.access import CONSOLE_KEY, ConsoleData
from proxy.console.api import build_console

__all__ = ["CONSOLE_KEY", "ConsoleData", "build_console"]
