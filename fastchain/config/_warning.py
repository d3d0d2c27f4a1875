"""``FastchainWarning``, in a module of its own: every part of fastchain warns
with it, and none of them should import ``enable()``'s machinery to do so."""


class FastchainWarning(UserWarning):
    """fastchain's warnings: an option asked for that cannot take effect here,
    one that has no effect, a fallback, a caveat of what is in force."""
