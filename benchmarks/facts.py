"""What the benchmarks know per method, keyed by the registry's method name: the evidence protocols' arms, the
learning runs, the dry run's parameter figures and cost-model counts, which single-method benchmark measures which
method. These are facts of the benchmarks, not of the methods: the model classes (cse.models.methods) hold the
papers' objectives only. A method with no entry here (a new one, the tests' toy) takes part in no evidence protocol,
has no learning run and no dry-run figure (`facts(name)` gives the empty `MethodFacts`).

`evidence_arms`, `evidence_position`, the overrides and the mechanism arms are covered by benchmarks/evidence.py's
protocol hash, `evidence_v2_arms` and `evidence_power_knob` by benchmarks/evidence_v2.py's: an edit here changes the
hash, and the stored records then no longer count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# (name, label, overrides over the protocol)
ArmFact = tuple[str, str, dict[str, Any]]


@dataclass(frozen=True)
class MethodFacts:
    """One method's facts for the benchmarks (every field empty / None: the method is in no benchmark).

    Args:
        evidence_position: the position of the method's cells in benchmarks/evidence.py and evidence_v2.py.
        evidence_arms: benchmarks/evidence.py's arms; the first is the method, the others its controls.
        evidence_overrides: what the evidence protocol sets over the smoke preset, from the protocol dict.
        evidence_mechanism_arms: the arms that get the held-out RTD mechanism check (true / shuffled / no h).
        evidence_head_lr_sensitivity: this method's are the head-learning-rate sensitivity rows.
        evidence_v2_arms: benchmarks/evidence_v2.py's arms (protocol 2).
        evidence_power_knob: protocol 2's proxy knob and the values its power check tries, in order (None: the
            job's single rate).
        learning_runs: benchmarks/learning.py's runs: run name → preset, steps, eval_steps, overrides, lr_note.
        learning_peer_run: the run the sentence-transformers peer cross-check reproduces.
        benchmark_subject_of: the single-method benchmarks that measure this method (benchmarks/machine.py
            `subject_method`).
        dry_run_trainable: (backbone, model config) → (trainable, prefix-phase trainable) parameters the reference
            gives (None: no figure), benchmarks/dry_run.py checks a build against them.
        dry_run_encoder_passes: encoder passes per view of a training step (the dry run's cost model): an int or a
            function of the model config.
        dry_run_template_ids: the ids a prompt template adds to a sentence (~).
    """

    evidence_position: int | None = None
    evidence_arms: tuple[ArmFact, ...] = ()
    evidence_overrides: Callable[[dict], dict] | None = None
    evidence_mechanism_arms: tuple[str, ...] = ()
    evidence_head_lr_sensitivity: bool = False
    evidence_v2_arms: tuple[ArmFact, ...] = ()
    evidence_power_knob: tuple[str, tuple[float | None, ...]] | None = None
    learning_runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    learning_peer_run: str | None = None
    benchmark_subject_of: tuple[str, ...] = ()
    dry_run_trainable: Callable[[str, Any], tuple[int | None, int | None]] | None = None
    dry_run_encoder_passes: int | Callable[[Any], int] = 1
    dry_run_template_ids: int = 0


# ------------------------------------------------------------------------------------------------ D2CSE
# Evidence: the controls remove the CRTD loss (lambda = 0) and the conditioning of the discriminator on h (the D2CSE
# paper's ablation (c)); the mechanism check runs on the arms whose RTD head trains, and the head-learning-rate
# sensitivity rows are this method's. Protocol 2: the method and lambda = 0, and the first BN-MLP + RTD head rate at
# which the RTD head learns to read h. Dry run: the discriminator reads the corrupted sentence (2 passes per view).
_D2CSE_ARMS: tuple[ArmFact, ...] = (
    ("method", "D2CSE (lambda 0.005, conditioned)", {}),
    ("lambda0", "control: lambda = 0", {"model": {"rtd_weight": 0.0}}),
    ("ablation-c", "control: ablation (c), unconditioned discriminator", {"model": {"condition_discriminator": False}}),
)


def _d2cse_trainable(backbone: str, config) -> tuple[int | None, int | None]:
    """On bert-base-uncased: prefix P·2·L·d (L 12, d 768) + BN-MLP 2,362,368 + RTD head 1,538 (+ [CLS] prompt 768)."""
    if config.train_discriminator or config.prefix_projection or backbone != "bert-base-uncased":
        return None, None
    return config.prefix_len * 2 * 12 * 768 + 2_362_368 + 1_538 + (768 if config.cls_prompt else 0), None


D2CSE = MethodFacts(
    evidence_position=2,
    evidence_arms=_D2CSE_ARMS,
    evidence_mechanism_arms=("method", "ablation-c"),
    evidence_head_lr_sensitivity=True,
    evidence_v2_arms=_D2CSE_ARMS[:2],
    evidence_power_knob=("head_learning_rate", (None, 2e-3, 2e-4)),
    learning_runs={
        "d2cse": dict(preset="smoke", steps=30, eval_steps=15, overrides={}, lr_note="smoke preset 1e-1 (paper 2.1e-2)")
    },
    # training_throughput: its step vs a bare encoder step; peft_adapter: its PEFT export; prompt_start: position
    # shifting of its prompts
    benchmark_subject_of=("training_throughput", "peft_adapter", "prompt_start"),
    dry_run_trainable=_d2cse_trainable,
    dry_run_encoder_passes=2,
)

# ------------------------------------------------------------------------------------------------ SimCSE
# Evidence: the control removes the defining mechanism, dropout noise (the SimCSE paper's "no dropout" row). The
# peer cross-check of benchmarks/learning.py reproduces the run "simcse"; gpu_speed measures it beside
# sentence-transformers' trainer (the same objective).
SIMCSE = MethodFacts(
    evidence_position=0,
    evidence_arms=(
        ("method", "SimCSE unsup (dropout 0.1)", {}),
        ("no-dropout", "control: dropout 0", {"model": {"dropout": 0.0}}),
    ),
    learning_runs={
        "simcse": dict(
            preset="smoke", steps=80, eval_steps=40, overrides={}, lr_note="preset 3e-5 (SimCSE BERT-base unsup)"
        ),
        "simcse-sup": dict(
            preset="sup",
            steps=30,
            eval_steps=15,
            overrides={"backbone": "packaged:minilm", "system_metrics": False},
            lr_note="preset 5e-5 (SimCSE sup)",
        ),
    },
    learning_peer_run="simcse",
    benchmark_subject_of=("gpu_speed_peer",),
)

# ------------------------------------------------------------------------------------------------ DCPCSE
# Evidence: the control freezes the prompts, the method's only trained part besides the training-time MLP.
# Dry run: trainable parameters by (backbone, prefix_len, mlm) where the reference gives the figure: prefix P·2·L·d +
# the cls MLP (+ with mlm the LM head: dense, LayerNorm, decoder and bias); the MLM loss adds a masked pass.
DCPCSE_TRAINABLE = {
    ("bert-base-uncased", 16, False): 294_912 + 590_592,
    ("bert-large-uncased", 10, False): 491_520 + 1_049_600,
    ("roberta-base", 14, True): 258_048 + 590_592 + 590_592 + 1_536 + 768 * 50_265 + 50_265,
}


def _dcpcse_trainable(backbone: str, config) -> tuple[int | None, int | None]:
    if config.prefix_projection:
        return None, None
    return DCPCSE_TRAINABLE.get((backbone, config.prefix_len, bool(config.mlm))), None


DCPCSE = MethodFacts(
    evidence_position=1,
    evidence_arms=(
        ("method", "DCPCSE (prompts learn)", {}),
        ("frozen-prompts", "control: prompts frozen", {"model": {"train_prompts": False}}),
    ),
    learning_runs={
        "dcpcse": dict(
            preset="smoke", steps=40, eval_steps=20, overrides={}, lr_note="smoke preset 2e-2 (paper 3e-2 at batch 256)"
        )
    },
    dry_run_trainable=_dcpcse_trainable,
    dry_run_encoder_passes=lambda config: 2 if config.mlm else 1,
)

# ------------------------------------------------------------------------------------------------ DiffCSE
# Evidence: the control removes the RTD loss (lambda = 0: SimCSE with DiffCSE's BN-MLP head); the mechanism check
# runs on the method arm. Protocol 2: the same arms, and the first discriminator + RTD-head rate at which the RTD side
# learns to read h. Dry run: the discriminator reads the corrupted sentence.
_DIFFCSE_ARMS: tuple[ArmFact, ...] = (
    ("method", "DiffCSE (lambda 0.005)", {}),
    ("lambda0", "control: lambda = 0", {"model": {"rtd_weight": 0.0}}),
)
DIFFCSE = MethodFacts(
    evidence_position=3,
    evidence_arms=_DIFFCSE_ARMS,
    evidence_mechanism_arms=("method",),
    evidence_v2_arms=_DIFFCSE_ARMS,
    evidence_power_knob=("discriminator_learning_rate", (None, 1e-4, 1e-3)),
    learning_runs={
        "diffcse": dict(
            preset="smoke",
            steps=30,
            eval_steps=15,
            overrides={},
            lr_note="smoke preset 2e-5 (paper 7e-6 at batch 64, 2 epochs of 1M)",
        )
    },
    dry_run_encoder_passes=2,
)


# ------------------------------------------------------------------------------------------------ DiffAug
# Evidence: the control is the DiffAug paper's "same prefix for both views" ablation in stage 2. Dry run: the ids
# its template adds to a sentence (~10), and the prefix-phase trainable parameters on bert-base-uncased with P 16
# (reparametrised prefix 14,777,088 + NLI classifier 4,610).
def _diffaug_evidence_overrides(protocol: dict) -> dict:
    """The main semi-supervised setting (no auxiliary NLI loss) and the smoke preset's rates, stage 1 for the
    protocol's `prefix_steps`."""
    return {
        "aux_nli_batch_size": 0,
        "model": {"aux_weight": 0.0},
        "prefix_phase": {"steps": protocol["prefix_steps"], "learning_rate": 1e-3, "batch_size": 32},
    }


def _diffaug_trainable(backbone: str, config) -> tuple[int | None, int | None]:
    if backbone == "bert-base-uncased" and config.prefix_len == 16:
        return None, 14_777_088 + 4_610
    return None, None


DIFFAUG = MethodFacts(
    evidence_position=4,
    evidence_arms=(
        ("method", "DiffAug (two prefix modules)", {}),
        ("shared-prefix", "control: same prefix for both views", {"model": {"shared_prefix": True}}),
    ),
    evidence_overrides=_diffaug_evidence_overrides,
    learning_runs={
        "diffaug": dict(
            preset="smoke",
            steps=24,
            eval_steps=18,
            overrides={"prefix_phase": {"steps": 12}},
            lr_note="smoke preset: stage 1 1e-3 (paper), stage 2 2e-5 (paper 1e-5 at batch 256)",
        )
    },
    dry_run_trainable=_diffaug_trainable,
    dry_run_template_ids=10,
)

FACTS: dict[str, MethodFacts] = {
    "d2cse": D2CSE,
    "simcse": SIMCSE,
    "dcpcse": DCPCSE,
    "diffcse": DIFFCSE,
    "diffaug": DIFFAUG,
}
NONE = MethodFacts()


def facts(method: str) -> MethodFacts:
    """The benchmarks' facts of a registry method (the empty `MethodFacts` for one they do not know)."""
    return FACTS.get(method, NONE)


def registry_facts() -> dict[str, MethodFacts]:
    """Method name → its facts, for every registry method, in registry order."""
    from cse.config.methods import REGISTRY

    return {name: facts(name) for name in REGISTRY}
