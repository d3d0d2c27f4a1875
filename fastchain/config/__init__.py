"""``fastchain.enable``: the options, the handle, and the record of changes."""

from fastchain.config._enable import FastchainWarning, Handle, enable
from fastchain.config._options import Group, Option, State

__all__ = ['FastchainWarning', 'Group', 'Handle', 'Option', 'State', 'enable']
