"""The paper's ViT-B schedule through commhooks' own rule: how often QSR syncs there (arXiv 2310.14423; the
authors' scripts, github.com/hmgxr128/QSR: 93,600 steps, 10,000 warm-up, peak lr 0.008, cosine to 1e-6, alpha
0.0175, h_base 4, init_h 4).  Run from the repository root: PYTHONPATH=hooks python3 results/<this dir>/paper_schedule.py"""
import json
import math
from pathlib import Path

from commhooks.algorithms.qsr.config import QSRConfig
from commhooks.algorithms.qsr.state import qsr_period

TOTAL, WARM, PEAK, FINAL = 93600, 10000, 0.008, 1e-6


def lr(step):
    if step < WARM:
        return FINAL + (PEAK - FINAL) * step / WARM
    return FINAL + (PEAK - FINAL) * 0.5 * (1 + math.cos(math.pi * (step - WARM) / (TOTAL - WARM)))


def rounds(cfg):
    step, periods = 0, []
    while step < TOTAL:
        h = qsr_period(step, lr(step), cfg)
        periods.append((step, h))
        step += h
    return periods


rule = rounds(QSRConfig(alpha=0.0175, h_base=4, warmup_steps=WARM, total_steps=TOTAL))
fixed = rounds(QSRConfig(alpha=0.0, h_base=4, warmup_steps=WARM, total_steps=TOTAL))
out = {"source": "arXiv 2310.14423, the authors' ViT-B scripts (github.com/hmgxr128/QSR): 93600 steps, 10000 "
                 "warm-up, peak lr 0.008, cosine to 1e-6, alpha 0.0175, h_base 4",
       "rule_syncs": len(rule), "fixed_h4_syncs": len(fixed), "steps": TOTAL,
       "rule_share_of_steps": len(rule) / TOTAL, "rule_share_of_h4": len(rule) / len(fixed),
       "last_period": rule[-1][1],
       "period_at": {str(s): next(h for st, h in reversed(rule) if st <= s) for s in (15000, 41000, 79000)}}
print(json.dumps(out, indent=1))
(Path(__file__).parent / "paper_schedule.json").write_text(json.dumps(out, indent=2) + "\n")
