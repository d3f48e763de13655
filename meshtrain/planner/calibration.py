"""The planner's fitted numbers, written by `python bench/calibrate_planner.py`
(do not edit by hand), fitted on `meshtrain.planner.published.CALIBRATION`
alone, never on the runs the planner is validated on:

KERNEL_EFFICIENCY: the share of peak FLOP/s a bf16 step's matmuls (and the
  attention core) sustain where they are compute-bound;
ELEMENTWISE_PASSES: how often the elementwise work of a layer reads or writes
  the activations its matmuls produce (bf16, at the HBM bandwidth)."""

KERNEL_EFFICIENCY = 0.8216
ELEMENTWISE_PASSES = 18.0
FITTED_ON = (
    'Megatron-LM GPT 3.6B',
    'Megatron-LM GPT 7.5B',
    'Megatron-LM GPT 39.1B',
    'Megatron-LM GPT 76.1B',
    'Megatron-LM GPT 310.1B',
    'Megatron-LM GPT 529.6B',
)
