"""``model hf ...`` as the checker records it (``planc.ir.HfModel``; re-exported there)."""

from __future__ import annotations

from dataclasses import dataclass, field

from planc.span import Span

__all__ = ["HfModel"]

_NOSPAN = Span(0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class HfModel:
    """``model hf "ARCH" { key = value ... }`` (``architecture`` and the config keys as written) or
    ``model hf "dir"`` (``folder``, relative to the plan file's folder): a Hugging Face causal LM
    (docs/models.md, "Hugging Face models"). ``key_spans``: where each key is written; ``ref_span``: the
    string."""

    architecture: str | None
    folder: str | None
    config: tuple[tuple[str, object], ...] = ()
    span: Span = field(default=_NOSPAN, compare=False, repr=False)
    ref_span: Span = field(default=_NOSPAN, compare=False, repr=False)
    key_spans: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)

    @property
    def label(self) -> str:
        """How messages name it: ``hf "LlamaForCausalLM"`` or ``hf "dir"``."""
        return f'hf "{self.architecture or self.folder}"'

    # messages written for builder models read ``path:function``
    @property
    def path(self) -> str:
        return "hf"

    @property
    def function(self) -> str:
        return self.architecture or self.folder or ""

    @property
    def args(self) -> tuple[tuple[str, object], ...]:
        return self.config

    def key_span(self, key: str) -> Span:
        return dict(self.key_spans).get(key, self.span)
