"""What a merge's logit check may show for the dtype the merged weights were saved in.

An fp32 merge saves the fp32 sum (dequantized base + update) as it is: only the forwards' float order
separates its logits from the fp32 4-bit base + adapter (measured up to 2e-5 on the tiny models).
A 16-bit merge rounds each summed weight once, to within half an ulp (bf16: 2^-8 relative); on the
tiny models (default Llama, Mixtral, gpt-oss, Llama 4; bf16 on an AMX Xeon) that moved the logits by
0.33 to 0.77 of 2^-8 times the largest logit, so the check holds them to one ulp (the dtype's eps,
2^-7 for bf16) of it.
"""

FP32_LOGIT_BOUND = 1e-4


def merged_logit_bound(report: dict) -> float:
    """The largest |merged - base + adapter| logit difference `report` (a merge_report.json) may show."""
    import torch

    if report["dtype"] == "float32":
        return FP32_LOGIT_BOUND
    eps = torch.finfo(getattr(torch, report["dtype"])).eps
    return eps * report["compare"]["vs_base_plus_adapter"]["ref_logit_absmax"]
