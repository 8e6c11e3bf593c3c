"""The process group: collectives over a set of ranks."""

from .config import GroupConfig
from .group import Group

__all__ = ["Group", "GroupConfig"]
