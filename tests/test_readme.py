"""The README's settings table is generated from Settings; this keeps it from drifting."""

from pathlib import Path

from server.settings import settings_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_when_settings_change_then_table_is_regenerated():
    assert settings_table() in README.read_text(), "run `python -m server.settings` and paste the table"


def test_readme_names_the_two_commands():
    text = README.read_text()
    assert "make run" in text and "make test" in text


def test_readme_when_read_then_it_stays_short_enough_for_users():
    """History and numbers live in docs/performance.md; the README keeps what a user needs."""
    assert len(README.read_text().splitlines()) <= 200
