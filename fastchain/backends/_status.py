import dataclasses


@dataclasses.dataclass(frozen=True)
class Status:
    """What a probe found.

    Attributes:
        available (bool): usable in this process.
        version (str or None): the version found, if any.
        why (str or None): when not available, the reason.
        fix (str or None): when not available, what to do about it.
        detail (dict): anything else worth showing (paths, counts).
    """

    available: bool
    version: str = None
    why: str = None
    fix: str = None
    detail: dict = dataclasses.field(default_factory=dict)

    def as_dict(self):
        return dataclasses.asdict(self)
