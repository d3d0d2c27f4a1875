"""benchmarks/breakdown.py: reading PyTorch profiler traces (the device side,
from a trace in the schema PyTorch's profiler writes on a GPU, and a real
one recorded here), placing a kernel's launch in the host's phases, and the
whole script on a CPU at a toy size."""

import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'benchmarks'))
import breakdown  # noqa: E402


def _event(cat, name, ts, dur, **args):
    return {'ph': 'X', 'cat': cat, 'name': name, 'pid': 1, 'tid': 7, 'ts': ts, 'dur': dur,
            'args': args}


def _gpu_trace():
    """Two annotated steps, [1000, 1100) and [1200, 1300) us, in the events
    PyTorch's profiler (Kineto) writes for a GPU run: kernels and copies on
    the device, the launch calls (runtime and driver API) on the host, each
    pair sharing a correlation id; one kernel between the steps."""
    return {'traceEvents': [
        {'ph': 'M', 'name': 'process_name', 'pid': 1, 'tid': 0, 'ts': 0, 'args': {}},
        _event('user_annotation', breakdown.STEP_ANNOTATION, 1000, 100),
        _event('user_annotation', breakdown.STEP_ANNOTATION, 1200, 100),
        _event('user_annotation', 'something else', 1000, 300),
        _event('cuda_driver', 'cuLaunchKernel', 1002, 3, correlation=1),
        _event('cuda_runtime', 'cudaLaunchKernel', 1004, 3, correlation=2),
        _event('cuda_runtime', 'cudaMemcpyAsync', 1040, 3, correlation=3),
        _event('cuda_driver', 'cuLaunchKernel', 1205, 3, correlation=5),
        _event('kernel', 'im2col', 1010, 20, correlation=1),
        _event('kernel', 'sm90_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x32', 1020, 30,
               correlation=2),
        _event('gpu_memcpy', 'Memcpy HtoD (Pageable -> Device)', 1060, 10, correlation=3),
        _event('kernel', 'cupy_multiply__float32_float32_float32', 1150, 10, correlation=4),
        _event('kernel', 'momentum_sgd', 1210, 50, correlation=5),
    ]}


def test_device_breakdown_of_a_gpu_trace():
    read = breakdown.read_trace(_gpu_trace())
    assert read['steps'] == [(1000.0, 1100.0), (1200.0, 1300.0)]
    assert read['launches'] == {1: 1002.0, 2: 1004.0, 3: 1040.0, 5: 1205.0}
    phases = {1002.0: 'forward', 1004.0: 'backward', 1040.0: 'convert', 1205.0: 'update'}
    d = breakdown.device_breakdown(read, phases.get)
    # step 1: im2col [1010, 1030) and the GEMM [1020, 1050) overlap (40 us
    # covered), the copy 10 more; step 2: the update, 50: both 50 of 100 us
    assert d['steps'] == 2 and d['busy'] == pytest.approx(0.05)
    assert d['idle_share'] == pytest.approx(0.5) and d['step'] == pytest.approx(0.1)
    # the kernel between the steps is no step's
    assert d['work'] == 4
    # per step (2 steps): each kind's summed time, not the union
    assert d['kinds'] == pytest.approx({'convolution (im2col + col2im)': 0.01,
                                        'GEMM': 0.015, 'copy': 0.005,
                                        'optimizer update': 0.025})
    assert d['phases'] == pytest.approx({'forward': 0.01, 'backward': 0.015,
                                         'convert': 0.005, 'update': 0.025})
    assert d['top'][0] == ('momentum_sgd', 0.025)
    # no locator: no phases; a launch the trace lacks: 'unknown'
    assert breakdown.device_breakdown(read)['phases'] == {}
    assert breakdown.device_breakdown(read, lambda t: None)['phases'] == {'unknown': 0.055}


@pytest.mark.parametrize('name, expected', [
    ('im2col', 'convolution (im2col + col2im)'),
    ('col2im', 'convolution (im2col + col2im)'),
    ('sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc', 'convolution (cuDNN)'),
    ('cudnn_generated_fort_native_conv_dgrad', 'convolution (cuDNN)'),
    ('void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1, true>',
     'batch normalization'),
    ('void at::native::batch_norm_collect_statistics_channels_last_kernel<float>',
     'batch normalization'),
    ('bn_bwd', 'batch normalization'),
    ('void cudnn::pooling_fw_4d_kernel<float, float, cudnn::maxpooling_func<float>>',
     'pooling'),
    ('void cudnn::detail::softmax_fw_kernel<2, float, float, 256, 1, 1, 0>', 'softmax and loss'),
    ('void cudnn::ops::activation_fw_4d_kernel<float, float, 128, 1, 4>', 'elementwise'),
    ('cudnn_generated_fort_native_sm90_fused_conv_bias_activation', 'convolution (cuDNN)'),
    ('nchwToNhwcKernel', 'layout (NCHW <-> NHWC)'),
    ('nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTN', 'GEMM'),
    ('cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4', 'GEMM'),
    ('momentum_sgd', 'optimizer update'),
    ('void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>>', 'optimizer update'),
    ('ncclDevKernel_AllReduce_Sum_f32_RING_LL', 'allreduce (NCCL)'),
    ('Memcpy HtoD (Pageable -> Device)', 'copy'),
    ('cupy_copy__float32_float16', 'copy'),
    ('cupy_sum', 'reduction'),
    ('cupy_multiply__float32_float32_float32', 'elementwise'),
    ('cupy_maximum__float32_float32_float32', 'elementwise'),      # Chainer's ReLU
    ('cupy_var_core_float32', 'reduction'),
    ('cupy_max', 'reduction'),
    ('max_pool_fwd', 'pooling'),
    ('void at::native::(anonymous namespace)::max_pool_forward_nhwc<c10::Half>', 'pooling'),
    ('softmax_crossent_bwd', 'softmax and loss'),
    ('void (anonymous namespace)::cunn_SoftMaxForward<4, float>', 'softmax and loss'),
    ('void splitKreduce_kernel<32, 16, int, float, float>', 'GEMM'),
    ('void gemv2T_kernel_val<int, int, float, float, float, 128, 16>', 'GEMM'),
    ('void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>', 'reduction'),
    ('void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>',
     'elementwise'),
])
def test_kinds_of_kernel_names(name, expected):
    assert breakdown.kind(name) == expected


def test_union_of_intervals():
    assert breakdown.union([]) == 0
    assert breakdown.union([(0, 10), (5, 8), (20, 25), (9, 12)]) == 17
    assert breakdown.union([(3, 4), (0, 1)]) == 2


def test_phase_locator_matches_the_clocks_by_the_steps():
    from fastchain.nvtx._summary import Range
    # host ns: a step at 5_000_000 with forward and backward inside, its
    # trace start at 1000 us (the clocks 4_000_000 ns apart)
    ranges = [Range('step', 'step', 1, 5_000_000, 5_100_000, 0),
              Range('forward', 'forward', 1, 5_000_000, 5_040_000, 1),
              Range('backward', 'backward', 1, 5_040_000, 5_090_000, 1),
              Range('res2/a/conv1', 'link', 1, 5_001_000, 5_002_000, 2)]
    at = breakdown.phase_locator(ranges, [5_000_000, 6_000_000], [1000.0, 2000.0])
    assert at(1010.0) == 'forward'          # 5_010_000 ns, the link range is no phase
    assert at(1001.5) == 'forward'
    assert at(1050.0) == 'backward'
    assert at(1095.0) == 'other'            # inside the step, in no phase of it
    assert at(1200.0) is None
    assert breakdown.phase_locator(ranges, [], []) is None
    assert breakdown.phase_locator(ranges, [1], [1.0, 2.0]) is None


def test_a_real_profiler_trace_is_read():
    """A trace PyTorch's profiler records here (no GPU: no kernels): its step
    annotations are found, on a clock the locator can match to the host's;
    the timed steps run before the profiled ones, without the profiler."""
    torch = pytest.importorskip('torch')
    x = torch.ones(32, 32)
    calls = []

    def step():
        calls.append(torch.autograd.profiler._is_profiler_enabled)
        return x @ x
    out = breakdown.measure(step, lambda: None, steps=2, warmup=1, profiled=3)
    assert calls == [False] * 3 + [True] * 3
    assert len(out['walls']) == 2 and len(out['starts']) == len(out['profiled_walls']) == 3
    assert out['profiled_from'] <= out['starts'][0]
    read = breakdown.read_trace(json.loads(json.dumps(out['trace'])))
    assert len(read['steps']) == 3 and read['work'] == []
    # the clocks differ by one offset: each step's (trace - host) within 1 ms of the others
    gaps = [t * 1e3 - h for h, (t, _) in zip(out['starts'], read['steps'])]
    assert max(gaps) - min(gaps) < 1e6
    d = breakdown.device_breakdown(read)
    assert d['steps'] == 3 and d['busy'] == 0 and d['idle_share'] == 1
    assert breakdown.measure(step, lambda: None, steps=1, warmup=0)['trace'] is None


def _cpu_run(tmp_path, variants, steps=3):
    return breakdown.run(breakdown.parse([
        '--device', '@numpy', '--batch', '2', '--crop', '32', '--width', '4', '--steps',
        str(steps), '--warmup', '3', '--results', str(tmp_path), '--variants', variants]))


def test_the_script_on_a_cpu(tmp_path):
    result = _cpu_run(tmp_path, 'baseline,cudnn,static_graph')
    with open(tmp_path / 'breakdown.json') as f:
        written = json.load(f)
    assert written['ratios'] == result['ratios']
    rows = {r['name']: r for r in written['rows']}
    assert set(rows) == {'baseline', 'static_graph'} and rows['baseline']['windows'] == 3
    assert [u['name'] for u in written['unavailable']] == ['cudnn']
    variants = written['config']['variants']
    assert set(variants) == {'baseline', 'static_graph'}
    for name in ('baseline', 'static_graph'):
        v = variants[name]
        phases = v['host_phases_ms']
        assert phases['forward'] > 0 and phases['backward'] > 0 and phases['update'] > 0
        # the timed steps' own timeline (the warm-up's left out), each inside
        # its step's wall time (read after the synchronisation)
        assert len(v['host_steps_ms']) == len(v['walls_ms']) == 3
        for host, wall in zip(v['host_steps_ms'], v['walls_ms']):
            assert 0 < host <= wall
        assert 'device' not in v and 'profiled_step_ms' not in v     # no GPU: no kernels
    assert (tmp_path / 'breakdown.md').read_text().startswith('## breakdown')
    # what each variant ran with is in the report: the rung's options, autotune off
    assert variants['baseline']['options']['cudnn'] == 'never'
    assert variants['static_graph']['options']['static_graph'] is True
    assert variants['static_graph']['options']['autotune'] is False
    assert written['config']['variants_asked'] == ['baseline', 'cudnn', 'static_graph']


@pytest.mark.parametrize('argv, message', [
    (['--variants', 'baseline,nope'], '--variants: unknown nope'),
    (['--variants', 'baseline,torch,baseline'], '--variants: baseline given more than once'),
    (['--windows', '3'], '--windows: the breakdown has no windows; --steps sets'),
])
def test_wrong_arguments_are_refused_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit):
        breakdown.parse(argv)
    assert message in capsys.readouterr().err


def test_a_variant_that_fails_is_named_and_the_others_still_run(tmp_path, monkeypatch):
    import fastchain
    real = breakdown.chainer_variant

    handles_at_build = {}

    def failing(name, *args):
        handles_at_build[name] = list(fastchain.active_handles())
        if name == 'static_graph':
            fastchain.enable(static_graph=True)     # a handle left behind by the failure
            raise RuntimeError('out of memory (stand-in)')
        return real(name, *args)
    monkeypatch.setattr(breakdown, 'chainer_variant', failing)
    _cpu_run(tmp_path, 'static_graph,baseline', steps=2)
    with open(tmp_path / 'breakdown.json') as f:
        written = json.load(f)
    assert [r['name'] for r in written['rows']] == ['baseline']
    assert written['unavailable'] == [{'name': 'static_graph', 'why': 'failed: RuntimeError: '
                                       'out of memory (stand-in)'}]
    assert 'out of memory (stand-in)' in written['config']['variants']['static_graph']['error']
    assert 'static_graph: failed: RuntimeError: out of memory (stand-in)' in written['notes']
    # the failed variant's handle was disabled before the next variant was built
    assert handles_at_build == {'static_graph': [], 'baseline': []}


def test_a_run_cut_off_keeps_the_variants_done(tmp_path, monkeypatch):
    real = breakdown.chainer_variant

    def interrupted(name, *args):
        if name == 'static_graph':
            raise KeyboardInterrupt         # as a run stopped from outside
        return real(name, *args)
    monkeypatch.setattr(breakdown, 'chainer_variant', interrupted)
    with pytest.raises(KeyboardInterrupt):
        _cpu_run(tmp_path, 'baseline,static_graph', steps=2)
    with open(tmp_path / 'breakdown.json') as f:
        written = json.load(f)
    assert [r['name'] for r in written['rows']] == ['baseline']
    assert written['notes'][-1] == 'Written after baseline: the run had not finished.'


def test_an_error_while_cleaning_up_is_reported_and_the_next_variant_runs(tmp_path,
                                                                          monkeypatch):
    import gc
    real, failed = gc.collect, []

    def collect(*args):
        if not failed:
            failed.append(1)
            raise RuntimeError('device lost (stand-in)')
        return real(*args)
    monkeypatch.setattr(gc, 'collect', collect)
    _cpu_run(tmp_path, 'baseline,static_graph', steps=2)
    with open(tmp_path / 'breakdown.json') as f:
        written = json.load(f)
    assert [r['name'] for r in written['rows']] == ['baseline', 'static_graph']
    assert written['config']['run']['cleanup_errors'] == [
        'baseline: giving its memory back: RuntimeError: device lost (stand-in)']
    assert 'Error while cleaning up after baseline: giving its memory back: RuntimeError: ' \
           'device lost (stand-in)' in written['notes']


def test_the_batchnorm_graphs_variant_turns_on_the_switch_the_layer_reads(monkeypatch):
    from fastchain.cudnn import _layers
    assert breakdown.BN_ENV == _layers.BN_ENV
    assert breakdown.RUNG['static_graph_bn'] == 'static_graph'
    assert 'static_graph_bn' in breakdown.GPU_VARIANTS
    # the values the layer reads for each variant
    assert breakdown.BN_ON == {'static_graph_bn': '1', 'static_graph_stats': 'stats'}
    for name, value in breakdown.BN_ON.items():
        assert name in breakdown.GPU_VARIANTS and breakdown.RUNG[name] == 'static_graph'
        monkeypatch.setenv(_layers.BN_ENV, value)
        assert _layers.bn_mode() == {'1': 'graphs', 'stats': 'stats'}[value]
    monkeypatch.setenv(_layers.BN_ENV, 'before')
    breakdown.set_env(_layers.BN_ENV, None)
    assert _layers.BN_ENV not in os.environ
