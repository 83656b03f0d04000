"""One exception type for problems the user can fix (bad config, missing files, wrong data).

`train.py` prints these as a single message and exits with status 1; anything else is a bug and keeps its
traceback.
"""


class UserError(Exception):
    """A problem in the run's input, with a message that names it and says how to fix it."""
