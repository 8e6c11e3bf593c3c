"""The process group: collectives over a set of ranks."""

from .buckets import GradientBuckets
from .compress import ErrorFeedback
from .config import GroupConfig
from .group import Group

__all__ = ["ErrorFeedback", "GradientBuckets", "Group", "GroupConfig"]
