"""Stage kernels' checks of whole layers and models on CUDA: FlexAttention with documents against SDPA, each mixer's
2-layer model against the CPU (then trained, in bf16 autocast, generating with the cache), torch.compile against
eager; and the list of stage kernels' checks with their deadlines."""
import torch
import torch.nn.functional as F

from checks.kernels import check_cpu, check_dsa, check_fla, check_moe, check_peak
from checks.stage import (BF16_FWD_TOL, FWD_TOL, MIXERS, Check, Stage, counting, mismatch, norm_mismatch,
                          scalar_mismatch, training_model_config)


def document_positions(B: int, T: int) -> torch.Tensor:
    """position_ids [B, T] of packed documents: row b holds documents of T // 5, 1, T // 2 tokens and the rest
    (shifted by b, so the rows differ), row 1 starting mid-document."""
    rows = []
    for b in range(B):
        lengths = [T // 5 + b, 1, T // 2]
        lengths.append(T - sum(lengths))
        row = torch.cat([torch.arange(n) for n in lengths])
        rows.append(row + (7 if b == 1 else 0) * (torch.arange(T) < lengths[0]))
    return torch.stack(rows)


def check_flex(stage: Stage) -> None:
    """`attend` with document segments on CUDA (FlexAttention with the BlockMask) against SDPA with the
    boolean same-document causal mask, fp32 and bf16, outputs and q, k, v gradients, GQA 12 / 4 heads."""
    from model.segments import DocumentSegments
    from model.mixers.softmax import attend

    B, H, Hkv, T, D = 2, 12, 4, 600, 64
    positions = document_positions(B, T)
    mask = DocumentSegments(positions).attention_mask.to(stage.device)  # [B, 1, T, T] bool, the CPU path's mask

    for dtype, tol in ((torch.float32, FWD_TOL), (torch.bfloat16, BF16_FWD_TOL)):
        def case(dtype=dtype, tol=tol):
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(B, n, T, D, generator=g).to(stage.device, dtype) for n in (H, Hkv, Hkv))
            w = torch.randn(B, H, T, D, generator=g).to(stage.device)
            segments = DocumentSegments(positions.to(stage.device))
            results = []
            for use_flex in (True, False):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                if use_flex:
                    with counting("model.mixers.softmax", "_flex_attention") as calls:
                        o = attend(*leaves, segments)
                else:
                    o = F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
                results.append([o.detach(), *torch.autograd.grad((o.float() * w).sum(), leaves)])
            ran = [] if calls[0] else ["MISMATCH flex: attend did not call FlexAttention on CUDA"]
            return ran + [mismatch(f"flex {dtype} {name}", a, b, tol if name == "o" else 2 * tol)
                          for name, a, b in zip(("o", "dq", "dk", "dv"), *results)]
        stage.case(f"{str(dtype).removeprefix('torch.')}", case)


def small_model(mixer: str, vocab: int):
    """The mixer at its default options in 2 layers of model=125m's widths, 4 KV heads (GQA)."""
    from model import DecoderLM

    torch.manual_seed(0)
    return DecoderLM(training_model_config(mixer, vocab, ("model.num_hidden_layers=2", "model.num_key_value_heads=4")))


def check_model(stage: Stage) -> None:
    """Per mixer on a 2-layer model with document positions: CUDA fp32 vs CPU fp32 loss and logits; after a
    few AdamW steps on CUDA (the loss falls), bf16 autocast logits vs fp32; greedy generate with the cache vs
    the full forward."""
    vocab, T = 512, 256
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, T), generator=g)
    held_out = torch.randint(0, vocab, (2, T), generator=g)
    positions = document_positions(2, T)
    for mixer in MIXERS:
        def case(mixer=mixer):
            model = small_model(mixer, vocab).eval()
            out = []
            with torch.no_grad():
                ref = model(ids, labels=ids, position_ids=positions, use_cache=False)
                model.to(stage.device)
                x, pos = ids.to(stage.device), positions.to(stage.device)
                fp32 = model(x, labels=x, position_ids=pos, use_cache=False)
            out.append(scalar_mismatch(f"model {mixer} cuda fp32 loss vs cpu", fp32.loss.item(), ref.loss.item(), 2e-3))
            out.append(mismatch(f"model {mixer} cuda fp32 logits vs cpu", fp32.logits, ref.logits, 1e-2))
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            losses = []
            for _ in range(6):
                loss = model(x, labels=x, position_ids=pos, use_cache=False).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            if not losses[-1] < losses[0]:
                out.append(f"MISMATCH model {mixer}: the loss did not fall over 6 AdamW steps ({losses[0]:.3f} -> {losses[-1]:.3f})")
            model.eval()
            y, ypos = held_out.to(stage.device), pos
            with torch.no_grad():
                trained = model(y, position_ids=ypos, use_cache=False).logits
                with torch.autocast(stage.device, dtype=torch.bfloat16):
                    bf16 = model(y, position_ids=ypos, use_cache=False).logits
                out.append(norm_mismatch(f"model {mixer} bf16 autocast logits vs fp32 after 6 steps", bf16, trained, 5e-2))
                prompt = y[:1, :32]
                gen = model.generate(prompt, max_new_tokens=16, do_sample=False, use_cache=True, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=0)
                full = model(gen.sequences).logits[:, prompt.shape[1] - 1:-1]
                out.append(mismatch(f"model {mixer} generate with cache vs full forward logits",
                                    torch.stack(gen.logits, 1), full, 1e-2))
            return out
        stage.case(mixer, case)


COMPILE_MIXERS = ("softmax", "gdn")  # FlexAttention inside the graph; fla behind its graph break


def check_compile(stage: Stage) -> None:
    """torch.compile logits against eager, fp32, document positions."""
    vocab, T = 512, 256
    ids = torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(0)).to(stage.device)
    positions = document_positions(2, T).to(stage.device)
    for mixer in COMPILE_MIXERS:
        def case(mixer=mixer):
            model = small_model(mixer, vocab).to(stage.device).eval()
            with torch.no_grad():
                eager = model(ids, position_ids=positions, use_cache=False).logits
                compiled = torch.compile(model)(ids, position_ids=positions, use_cache=False).logits
            return [mismatch(f"compile {mixer} logits vs eager", compiled, eager, 1e-3)]
        stage.case(mixer, case)


KERNEL_CHECKS = [Check("cpu", check_cpu, 15, needs_cuda=False), Check("peak", check_peak, 10),
                 Check("fla", check_fla, 95), Check("moe", check_moe, 10), Check("dsa", check_dsa, 20),
                 Check("flex", check_flex, 20), Check("model", check_model, 30), Check("compile", check_compile, 20)]
