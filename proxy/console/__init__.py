"""The operator console at `/console/`: a page and a JSON API to see and cancel tasks (README "Console")."""

from proxy.console.api import CONSOLE_KEY, ConsoleData, build_console

__all__ = ["CONSOLE_KEY", "ConsoleData", "build_console"]
