"""What ``validate`` returns: a ``Report`` of ``Finding``s, each with a ``Severity``."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptool.format.metadata import CheckpointMetadata
from ckptool.format.text_enum import TextEnum


class Severity(TextEnum):
    """How bad a finding is. A ``str``: ``Severity.ERROR == "error"``, and JSON shows "error"."""

    ERROR = "error"
    WARNING = "warning"
    NOTE = "note"  # a fact worth knowing, not a problem


@dataclass(frozen=True)
class Finding:
    """One problem. ``code`` is stable (for scripts); ``message`` is for people."""

    severity: Severity  # a plain "error" | "warning" | "note" is accepted and converted
    code: str
    message: str
    path: str | None = None
    fqn: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "severity", Severity(self.severity))

    def __str__(self) -> str:
        return f"{self.severity}: {self.code}: {self.message}"


@dataclass(frozen=True)
class Report:
    """Everything ``validate`` found about one checkpoint; ``ok`` when no finding is an error."""

    path: str
    step: int | None = None
    world_size: int | None = None
    committed: bool = False
    deep: bool = False
    tensors: int = 0
    files: int = 0
    total_bytes: int = 0
    findings: tuple[Finding, ...] = ()
    metadata: dict[str, CheckpointMetadata] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not any(f.severity is Severity.ERROR for f in self.findings)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.ERROR]
