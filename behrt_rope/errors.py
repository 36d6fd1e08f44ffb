"""Errors a user can act on. The CLI prints their message on one line and exits non-zero."""

from __future__ import annotations


class UserError(Exception):
    """Base class: the message alone tells the user what went wrong and where."""


class InputSchemaError(UserError):
    """An input table lacks a column or has one of the wrong type (names the file, column, example row)."""


class ArtifactError(UserError):
    """A stage's input directory is missing a file another stage should have written."""
