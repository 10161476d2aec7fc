"""The operator console at `/console/`: a page and a JSON API to see and cancel tasks (README "Console")."""

from .api import build_console

__all__ = ["build_console"]
