"""The ``?`` help screen: a modal listing the dashboard's keys."""

from __future__ import annotations

import logging

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Static

logger = logging.getLogger(__name__)

#: Keys of ``skippyd top`` with what they do, in display order.
KEYS = (
    ("q", "quit"),
    ("p", "pause / resume the display (data is still read)"),
    ("/", "filter events: glob on names, or substring"),
    ("enter", "keep the filter, close its input"),
    ("escape", "clear the filter; close this help"),
    ("?", "this help"),
)


class HelpScreen(ModalScreen[None]):
    """A modal listing every key; escape, ``?`` or ``q`` closes it."""

    BINDINGS = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close", show=False),
        Binding("q", "dismiss", "Close", show=False),
    ]
    """
    | Key | Action |
    | :- | :- |
    | escape, ?, q | Close the help. |
    """

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        for key, action in KEYS:
            table.add_row(key, action)
        help_text = Static(table, id="help-keys")
        help_text.border_title = "skippyd top: keys"
        yield help_text
