"""The one error the results store raises: a one-line message that names the problem (and never a password)."""


class StoreError(Exception):
    pass
