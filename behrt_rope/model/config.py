"""The encoder's configuration: one dataclass passed whole to every module of the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class ModelConfig:
    """BEHRT with rotary position embedding. Defaults suit a laptop CPU."""

    vocab_size: int = 0
    """Number of token ids, special tokens included; set from the ETL vocabulary."""
    hidden_size: int = 128
    """Width of every token representation."""
    num_layers: int = 2
    """Number of transformer blocks. 2 since session 8: with label-code tying, 2 blocks matched or beat 4 on
    the tuning splits of both cohort families at half the training and scoring cost (docs/benchmarks.md,
    "Seventh round")."""
    num_heads: int = 4
    """Attention heads; hidden_size must divide by it and the head size must be even (RoPE pairs)."""
    intermediate_size: int = 256
    """Width of the feed-forward layer inside each block."""
    dropout: float = 0.1
    """Dropout on embeddings, attention output and feed-forward output."""
    attention_dropout: float = 0.0
    """Dropout on attention weights; above 0 it forces the slow SDPA math path on CPU."""
    time2vec_periodic: int = 16
    """k, the number of periodic Time2Vec features of age (plus one linear feature)."""
    age_scale: float = 100.0
    """Ages (years) are divided by this before Time2Vec, to keep the linear term near unit scale."""
    scale_code_embedding: bool = True
    """Multiply code embeddings by sqrt(hidden_size) (Vaswani et al. 2017) and start the Time2Vec projection
    at 1/sqrt(k + 1) of the usual scale, so a token's code, not its age, dominates its initial embedding."""
    num_segments: int = 2
    """Segment ids alternate between visits (A/B)."""
    sex_embedding: bool = True
    """Add an embedding of the patient's recorded sex (female, male, other; ``unknown`` embeds to zero) to
    every token, beside its code, segment and age (``behrt_rope/etl/sex.py``)."""
    visit_gap: bool = True
    """Add an embedding of the days between a token's visit and the visit before it to every token
    (``visit_gap.py``): a follow-up a week after a visit reads differently from a return after years. On
    since session 45: tuning macro AP of the model +0.0018 and of the deep part alone +0.0027 on average over
    seven cohorts (the clinical ones most); held out level for the model and a little ahead for the deep part;
    a training step's time unchanged within noise (docs/benchmarks.md, "Forty-first round")."""
    position_encoding: Literal["rope", "absolute"] = "rope"
    """rope: rotate queries and keys; absolute: BEHRT's additive sinusoidal table (ablation)."""
    position_source: Literal["visit", "token", "age"] = "visit"
    """What a token's position is: its visit index, its index in the stream, or its age."""
    rope_base: float = 10000.0
    """RoPE frequency base: theta_i = base^(-2(i-1)/d)."""
    rope_age_scale: float = 1.0
    """With position_source=age, position = age in years times this (e.g. 12 for months)."""
    age_heads: int = 2
    """Attention heads (the last ones of each layer) whose RoPE position is the age in days, while the others
    use position_source: one layer then sees both visits-since and days-since. 0: every head uses
    position_source. 2 of the 4 since session 22 (docs/benchmarks.md, "Twenty-first round"); it must not
    exceed num_heads."""
    max_positions: int = 512
    """Size of the sinusoidal table for position_encoding=absolute."""
    layer_norm_eps: float = 1e-12
    label_attention_heads: int = 2
    """Fine-tuning head (visit pooling): heads of the per-label attention over the history, in which each
    label has its own query (0: none). Head settings apply at finetune even with --pretrained (pre-training
    has no such head). On by default since it learns presence, counts and recency: with token keys, +0.002 to
    +0.007 tuning macro AP, at about 10% more CPU per training step than without it; 4 heads cost 1.26x the
    fine-tuning time of 2 for the same tuning AP (docs/benchmarks.md, "Settings study")."""
    history_max: bool = True
    """Fine-tuning head (visit pooling): the classifier also reads the elementwise max of the states of the
    history, which keeps a code recorded once visible however long the history grows."""
    label_attention_keys: Literal["visit", "token"] = "token"
    """What the per-label attention reads: every earlier code token, with a learned label-specific function
    of the days and visits since it was recorded (token; ``token_label_attention.py``), or the [SEP] states
    of earlier visits, half the heads rotated by visit index and half by age in days (visit)."""
    label_own_code: bool = True
    """Fine-tuning head (token label attention): each label also learns how much its *own* code's records
    weigh in its attention score and vote (per head, one score and one vote bias on the tokens that are the
    label's code), a copy prior so that "was this very code recorded, how often, how recently" is there from
    the first step instead of being found by a query; the model must be told the label codes. Tuning macro
    AP +0.0008 and +0.0026 on two tuning cohorts (docs/benchmarks.md, "Fourth round")."""
    label_first_record: bool = False
    """Fine-tuning head (token label attention): each label also learns, per head, a score and a vote bias on
    the code tokens that are the *first* record of their code in the patient's history, so it can attend to
    when a condition was first recorded (how long it has been on file) apart from when it was last recorded
    (how recent it is). The marker depends only on earlier tokens, so visit-causal scoring is unchanged. Off:
    level and -0.003 tuning macro AP on two tuning cohorts (docs/benchmarks.md, "Eighth round")."""
    label_time_steps: bool = True
    """Fine-tuning head (token label attention): the learned features of the time since a token was recorded
    are sigmoid steps over log(1 + days) and log(1 + visits), starting at fixed knots (a week, two weeks, each
    month of the first half year, 8 months, 1, 2 and 5 years; 1, 2, 4 and 8 visits;
    ``token_label_attention.STEP_DAYS``), so that a label can weigh records of an age window (a staircase; a
    bump as the difference of neighbouring steps) as sharply as binned features do; knots and slopes stay
    learned. On since session 59: on 45% tuning splits the deep part +0.0010 tuning macro AP on a clinical draw
    (delivery, due a few months after the first prenatal record: +0.03 to +0.06 AP on its three codes, the other
    labels level), level on a progression draw and a recurrence draw (docs/benchmarks.md, "Fifty-fifth round").
    False: GELU ramps of a random start, smooth in log time (the features of models saved before)."""
    label_code_tie: bool = True
    """Fine-tuning head (visit pooling): each per-label parameter of the classifier and of the label attention
    is its free value plus a shared map of the label's own code embedding (``label_codes.py``), so that labels
    share what they learn and a rare label starts from what pre-training learned about its code. Tuning macro
    AP +0.0045 and level on two tuning cohorts, and much faster early learning (docs/benchmarks.md, "Seventh
    round")."""
    age_basis: int = 32
    """Fine-tuning head (visit pooling): width of a learned basis of the age at the scored visit (GELU of a
    linear map of age / 10 and log(1 + age), in years) that the classifier reads beside Time2Vec(age), so that
    each label can have its own sharp age profile (childhood infections, pregnancy, old-age fractures); 0: off."""
    wide: bool = False
    """Fine-tuning head (visit pooling): add the wide linear path (``wide.py``) over log(1 + count) of each
    code seen and, with ``wide_time``, the time course of each label's own code."""
    wide_time: bool = True
    """The wide path also reads each label's own code's count, recency in visits and in days at learned
    scales, and years since first recorded (8 weights per label); false: the bag of codes alone."""
    sparse_time: bool = True
    """Fine-tuning head (visit pooling): add the sparse time path (``sparse_time_path.py``), an L1 logistic
    regression on binned timing of every label code (a relaxed lasso since session 33: ``finetune``
    ``sparse_time_select_c``) that ``finetune`` fits with scikit-learn before the deep training and keeps
    frozen; the model's logit is a weighted mean of the path's and the deep part's, the weight chosen on the
    tuning split (``finetune`` ``sparse_time_share``). On since session 11: tuning macro AP 0.4082 / 0.2538
    against 0.4021 / 0.2509 without it on two cohorts (gradient boosting 0.4009 / 0.2411), about 40 s more
    fine-tuning for 40,000 samples (docs/benchmarks.md, "Tenth round"). False: the deep model alone."""
    state_filter: int = 0
    """Fine-tuning head (visit pooling): states of a learned continuous-time hidden-state chain per label, whose
    forward filter over the visits adds one logit per label to the deep part (``state_filter.py``); 0: off.
    Off by default: 4 states lifted the model's tuning macro AP on two progression draws (+0.0025, +0.0002),
    a recurrence_sparse and a clinical draw (+0.0016 each), but it adds 17-34% to a training step, a budgeted
    fine-tuning got a third fewer epochs on a clinical draw, and on long dense histories it is worse (model
    -0.0018, deep part -0.0069 on a clean pair) (docs/benchmarks.md, "Forty-fourth round")."""

    state_path: int = 6
    """Fine-tuning head (visit pooling): states of the *state path* (``state_path.py``), the same chains as
    ``state_filter`` fitted apart after the deep part (``finetune`` ``state_path_*``) and averaged into the
    model's logit at a share chosen on the tuning split (0 unless a share is clearly better there); 0: no state
    path. 6 states since session 51 (4 before), with label codes that travel together sharing a chain
    (``finetune`` ``state_path_pair_correlation``): a shared chain holds two codes' stages. On by
    default since session 49: share chosen on one half of each tuning split and scored on the other, it added
    +0.0007 and +0.0021 tuning macro AP on two progression draws, 0.0000 on a clinical one and -0.0009 / -0.0002
    on a recurrence_sparse and a dense draw (mean +0.0003), for 1-5 minutes of fitting within the time budget
    (docs/benchmarks.md, "Forty-fifth round")."""
    state_path_copies: int = 3
    """With ``state_path``: sets of chains, each initialised and fitted on its own (its own batch order and best
    epoch), one after another within the time budget, and averaged in the path's logit: an ensemble of seeds.
    Three sets against one, share chosen on one half of each tuning split and scored on the other: +0.0043
    against +0.0035 macro AP on a progression draw (chains alone 0.1464 against 0.1439), +0.0006 against
    +0.0004 on a recurrence_sparse draw, -0.0003 either way on a clinical one, for three times the fit
    (docs/benchmarks.md, "Forty-sixth round")."""
    state_path_reach: int = 2
    """With ``state_path``: how far apart in the states' order two states of a chain may be for the chain to move
    between them (1: neighbours only, a birth-death chain; 2, the default since session 68: also one state over);
    0: any two states (models saved before load so). An ordered chain has fewer rates to learn (18 instead of 30
    at 6 states) and reads stages that follow one another: one set of chains alone, tuning macro AP against any
    two states, +0.0005 on a progression screening cohort (3 seeds; +0.0011 for three sets together), -0.0001 on a
    recurrence_sparse one (3 seeds), +0.0019 on a clinical one (2 seeds) (docs/benchmarks.md, "Sixty-fourth
    round")."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("the head size (hidden_size / num_heads) must be even for rotary embedding")
        if not 0 <= self.age_heads <= self.num_heads:
            raise ValueError(
                f"model.age_heads (heads rotated by the age in days) must lie in [0, num_heads={self.num_heads}], "
                f"got {self.age_heads}; with fewer heads set model.age_heads too"
            )
        if self.age_basis < 0:
            raise ValueError(f"age_basis must be >= 0, got {self.age_basis}")
        if self.state_filter < 0 or self.state_filter == 1:
            raise ValueError(f"state_filter (states per label chain) must be 0 (off) or >= 2, got {self.state_filter}")
        if self.state_path < 0 or self.state_path == 1:
            raise ValueError(f"state_path (states per label chain) must be 0 (off) or >= 2, got {self.state_path}")
        if self.state_path_copies < 1:
            raise ValueError(f"state_path_copies must be >= 1, got {self.state_path_copies}")
        if self.state_path_reach < 0:
            raise ValueError(f"state_path_reach must be >= 0 (0: any two states), got {self.state_path_reach}")
        if self.label_attention_heads < 0:
            raise ValueError(f"label_attention_heads must be >= 0, got {self.label_attention_heads}")
        if not 0.0 <= self.dropout < 1.0 or not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError("dropout and attention_dropout must lie in [0, 1)")


HEAD_FIELDS = (
    "label_attention_heads",
    "label_attention_keys",
    "history_max",
    "label_own_code",
    "label_code_tie",
    "label_first_record",
    "label_time_steps",
    "age_basis",
    "wide",
    "wide_time",
    "sparse_time",
    "state_filter",
    "state_path",
    "state_path_copies",
    "state_path_reach",
)
"""ModelConfig fields of the fine-tuning head; the encoder's other fields come with a pre-trained encoder."""
