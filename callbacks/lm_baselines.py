"""Baselines beside a language model: the bits per byte of unigram and bigram byte models.

A byte-level model's 2.5 bits per byte means little alone; a bigram table that gets 3.3 says
how much the network learned beyond byte frequencies and pairs. At fit start this callback asks
the datamodule for ``baseline_bits_per_byte()`` (``{"unigram": ..., "bigram": ...}``: add-one
smoothed models counted on the train split and scored on the validation bytes, as
``datamodules.text.TextDataModule`` provides) and logs the results from rank 0. A datamodule
without that method is skipped with a note. The figures are kept in the checkpoint: a resumed fit
logs them from there instead of counting them again at its start.

=========================  =====================================================
key                        meaning
=========================  =====================================================
``baseline/unigram_bpb``   validation bits per byte of byte frequencies alone
``baseline/bigram_bpb``    validation bits per byte given the previous byte
=========================  =====================================================

Copy with it: ``analysis/keys.py`` (the keys' names).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from .analysis.keys import VAL_BPB_KEY, bpb_baseline_key

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

log = logging.getLogger(__name__)


class LMBaselines(Callback):
    """Compute and log the n-gram baselines once per run (rank 0), and keep them for the end summary.

    Args:
        metric: the model's metric the baselines compare with (bits per byte; lower is better).

    Example::

        trainer = Trainer(callbacks=[LMBaselines()])
        trainer.fit(GPT(), datamodule=TextDataModule())   # logs baseline/unigram_bpb, baseline/bigram_bpb
    """

    def __init__(self, metric: str = VAL_BPB_KEY) -> None:
        self.metric = metric
        self.results: dict[str, float] = {}
        self._logged = False  # by this fit or an earlier one of this instance (a fit twice logs once)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero or self._logged:
            return
        if self.results:  # restored from the checkpoint: logged as the first launch did, not counted again
            self._log(trainer)
            return
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "baseline_bits_per_byte"):
            log.info("LMBaselines: the datamodule has no baseline_bits_per_byte(); skipped.")
            return
        self.results = {bpb_baseline_key(name): float(value)
                        for name, value in datamodule.baseline_bits_per_byte().items()}
        self._log(trainer)

    def _log(self, trainer: Trainer) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(self.results, step=0)
        self._logged = True

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"results": dict(self.results)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.results = {str(k): float(v) for k, v in state_dict.get("results", {}).items()}

    def summary_rows(self, metrics: dict[str, float]) -> list[tuple[str, str]]:
        """Rows for the end summary: each baseline and the model's difference from it (negative: better)."""
        model = metrics.get(self.metric)
        rows = []
        for key, value in self.results.items():
            lift = f"  (model {model - value:+.4f})" if model is not None else ""
            rows.append((key, f"{value:.4f}{lift}"))
        return rows
