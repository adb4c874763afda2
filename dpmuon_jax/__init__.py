"""dpmuon_jax: differentially private training with spectral optimizers in JAX/Optax."""

from dpmuon_jax.analysis.diagnostics import (
    LayerDiagnostics,
    PrivacyBudget,
    Spectrum,
    format_report,
    noise_edge,
    noise_operator_norm,
    nonprivate_layer_report,
    nonprivate_mean_clipped_gradient,
    plot_spectrum,
    recovery_threshold_batch_size,
    spectrum_summary,
    threshold_batch_size_at_fixed_sigma,
)
from dpmuon_jax.analysis.diagnostics import snr as spectral_snr
from dpmuon_jax.analysis.polar_metrics import (
    ClippingResidual,
    InnerMomentumProbe,
    PairedReduction,
    ProtocolCheckpoint,
    ProtocolResult,
    ProtocolRow,
    clipping_factors,
    clipping_residual,
    cosine_error,
    envelope_factor,
    history_weights,
    nonprivate_im_protocol,
    polar,
    polar_error,
    summarise_protocol,
    variance_ratio,
    weighted_combination,
)
from dpmuon_jax.audit.canaries import canary_membership
from dpmuon_jax.audit.clopper_pearson import epsilon_clopper_pearson
from dpmuon_jax.audit.one_run import epsilon_one_run, one_run_p_value
from dpmuon_jax.audit.run_audit import AuditConfig, audit
from dpmuon_jax.data.augment import augment, augment_image
from dpmuon_jax.data.embedded import load_embedded
from dpmuon_jax.data.images import DATASETS, DatasetInfo, ImageDataset, dataset_info, normalize
from dpmuon_jax.data.loaders import DATASET_NAMES, TFDS_NAMES, load_dataset, load_npz, load_tfds
from dpmuon_jax.distributed.mesh import data_mesh, shard_batch, sharded_capacity
from dpmuon_jax.linalg.newton_schulz import (
    DEFAULT_NS_COEFFS,
    POLAR_EXPRESS,
    NewtonSchulzSchedule,
    newton_schulz,
)
from dpmuon_jax.linalg.power_iteration import power_iteration
from dpmuon_jax.linalg.scaling import MatrixView, aspect_factor, matrix_view
from dpmuon_jax.models.cnn import SmallCNN, image_patches, patch_conv, small_cnn
from dpmuon_jax.models.common import PureModel, classification_loss, pure_model
from dpmuon_jax.models.registry import MODEL_NAMES, create_model, model_and_loss
from dpmuon_jax.models.resnet import ResNet
from dpmuon_jax.models.vit import VisionTransformer
from dpmuon_jax.models.wrn import WideResNet
from dpmuon_jax.optimizers import dp_adam, dp_adamw, dp_sgd
from dpmuon_jax.optimizers_filters import (
    disk_query_spec,
    dp_disk_muon,
    dp_disk_sgd,
    dp_doppler_muon,
    dp_doppler_sgd,
)
from dpmuon_jax.optimizers_im import (
    dp_adam_bc,
    dp_muon_bc,
    dp_muon_im,
    inner_momentum_query,
    inner_momentum_spec,
)
from dpmuon_jax.optimizers_muon import (
    dp_muon,
    dp_muon_s,
    fallback_optimizer,
    routed_post_processing,
)
from dpmuon_jax.privacy.accounting import (
    LedgerConfig,
    PrivacyLedger,
    calibrate_noise_multiplier,
    compute_epsilon,
    gaussian_release_event,
    make_accountant,
)
from dpmuon_jax.privacy.clipping import (
    Clipping,
    automatic_clipping,
    flat_clipping,
    per_layer_clipping,
)
from dpmuon_jax.privacy.disk_query import (
    DISK_PRESETS,
    DiskPreset,
    disk_query,
    disk_weight,
)
from dpmuon_jax.privacy.inner_momentum import (
    PAPER2_PRESETS,
    InnerMomentumInputs,
    InnerMomentumSettings,
    grouped_inner_momentum_query,
    inner_momentum_weights,
)
from dpmuon_jax.privacy.keys import KeyStreams, RootKey, root_key, split_streams
from dpmuon_jax.privacy.query import (
    GRADIENT_QUERY,
    ClippedSum,
    ClipStats,
    QuerySpec,
    clip_and_sum,
    clipped_sum,
    gradient_query,
)
from dpmuon_jax.privacy.release import (
    GaussianReleaseSpec,
    GaussianReleaseState,
    PrivateTransformation,
    dp_release,
    privatize,
)
from dpmuon_jax.privacy.sampling import (
    PADDING_INDEX,
    PaddedBatch,
    PoissonSampler,
    default_capacity,
    gather,
)
from dpmuon_jax.privacy.setup import PrivateSetup, make_private
from dpmuon_jax.text.data import (
    EvalGroup,
    TextDataset,
    TextPair,
    download_text_data,
    encode_pairs,
    encode_prompts,
    load_dart,
    load_e2e,
    load_text_dataset,
)
from dpmuon_jax.text.generate import Generation, beam_search, decode_texts, greedy_decode
from dpmuon_jax.text.gpt2 import (
    GPT2,
    GPT2_CPU,
    GPT2_SMALL,
    GPT2_TINY,
    GPT2Config,
    gpt2_model,
    lm_loss,
    token_nll,
)
from dpmuon_jax.text.hf_weights import load_hf_gpt2, save_hf_gpt2
from dpmuon_jax.text.metrics import bleu, dart_rouge_l, e2e_rouge_l, mean_token_nll, write_results
from dpmuon_jax.text.tokenizer import GPT2Tokenizer
from dpmuon_jax.text.train import (
    LM_OPTIMIZERS,
    DiagnosticProbe,
    LMTrainConfig,
    lm_optimizer,
    train_lm,
)
from dpmuon_jax.training.checkpoint import (
    TrainingCheckpoint,
    restore_checkpoint,
    save_checkpoint,
)
from dpmuon_jax.training.step import PrivateStep, StepOutput, make_private_step
from dpmuon_jax.training.trainer import TrainConfig, train
from dpmuon_jax.transforms.bias_correction import (
    KIM_FAN_NS_COEFFS,
    BiasCorrectionState,
    ScaleByAdamBCState,
    buffer_noise_variance,
    scale_by_adam_bc,
    scale_by_bias_corrected_orthogonalization,
)
from dpmuon_jax.transforms.buffer_noise import (
    DP_MUON_BUFFER,
    NO_MOMENTUM,
    BufferSpec,
    buffer_noise_factor,
)
from dpmuon_jax.transforms.filters import (
    DOPPLER_PRESETS,
    AppliedUpdateState,
    KalmanFilterState,
    LowPassCoefficients,
    LowPassFilterState,
    applied_update,
    kalman_filter,
    low_pass_filter,
    record_applied_update,
)
from dpmuon_jax.transforms.history import (
    ParamHistoryState,
    find_history,
    ordered_history,
    param_history,
)
from dpmuon_jax.transforms.momentum import MuonMomentumState, muon_momentum
from dpmuon_jax.transforms.muon import (
    SpectralScaleState,
    scale_by_muon,
    scale_by_muon_s,
    scale_by_orthogonalization,
    scale_by_spectral_orthogonalization,
)
from dpmuon_jax.transforms.routing import muon_labels, partition_muon
from dpmuon_jax.transforms.selective import (
    SelectiveState,
    orthogonalization_test,
    selective_orthogonalization,
)
from dpmuon_jax.transforms.shrinkage import (
    ShrinkageState,
    estimate_noise_std,
    frobenius_shrinker,
    marchenko_pastur_density,
    marchenko_pastur_median,
    optimal_hard_threshold,
    optimal_hard_threshold_coef,
    scale_by_singular_value_shrinkage,
    shrink_singular_values,
    spiked_singular_value,
    unknown_noise_threshold_coef,
)

__version__ = "0.1.0"
