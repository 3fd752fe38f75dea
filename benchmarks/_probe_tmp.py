# temporary diagnostic (not committed): graphed fwd+bwd, p=0 and p=0.05 alternated; per-kernel times of the p=0.05 one
import subprocess, torch
from torch.profiler import ProfilerActivity, profile
from benchmarks.kernels import make_pack, graphed_fwd_bwd_ms, m_fused, params_of, fwd_bwd_step
dev = torch.device('cuda')
def clocks():
    return subprocess.run(['nvidia-smi', '--query-gpu=clocks.sm,temperature.gpu,power.draw', '--format=csv,noheader'], capture_output=True, text=True).stdout.strip()
for in_f, out_f in ((4096, 14336), (4096, 4096)):
    p0 = make_pack(in_f, out_f, 16384, 1, [16], 0.0, dev); p5 = make_pack(in_f, out_f, 16384, 1, [16], 0.05, dev)
    print(in_f, out_f, clocks())
    for i in range(3):
        print('  p=0 %.3f  p=.05 %.3f  %s' % (graphed_fwd_bwd_ms(m_fused, p0), graphed_fwd_bwd_ms(m_fused, p5), clocks()))
    for name, p in (('p0', p0), ('p5', p5)):
        dy = torch.randn_like(m_fused(p)); params = params_of(p)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5): fwd_bwd_step(m_fused, p, dy, params)
            torch.cuda.synchronize()
        ks = sorted(((e.device_time_total / 5e3, e.key[:40]) for e in prof.key_averages() if e.device_time_total and not e.key.startswith(('aten', 'autograd', 'cuda'))), reverse=True)[:8]
        print('  ', name, ' '.join('%s=%.3f' % (k, t) for t, k in ks))
