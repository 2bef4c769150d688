"""The files the Job steps commit and the operator reads back (stage.json, train.json,
eval.json, analysis.json), one versioned model each, shared by both images: the steps
write through them, the planner, ``kubectl rtrl``, the metrics and the demo read through
them (:mod:`.contract` says how versions are read). Pure: no I/O."""

from rtrl.core.api.checkpoint import Decision

from .analysis import AnalysisCause, AnalysisMetric, AnalysisResult, CauseKind
from .contract import ResultError, ResultPart, StepResult
from .evaluation import EvalFailure, EvalGate, EvalResult, GatesSource
from .stage import FidelityFigures, FidelityGate, RewardFigures, StageResult
from .train import TrainResult

# The result file of each step, by the step's name.
RESULTS: dict[str, type[StepResult]] = {
    "stage": StageResult,
    "train": TrainResult,
    "eval": EvalResult,
    "analyze": AnalysisResult,
}

__all__ = [
    "RESULTS",
    "AnalysisCause",
    "AnalysisMetric",
    "AnalysisResult",
    "CauseKind",
    "Decision",
    "EvalFailure",
    "EvalGate",
    "EvalResult",
    "FidelityFigures",
    "FidelityGate",
    "GatesSource",
    "ResultError",
    "ResultPart",
    "RewardFigures",
    "StageResult",
    "StepResult",
    "TrainResult",
]
