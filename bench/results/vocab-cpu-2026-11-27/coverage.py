import json, torch, sys
from pathlib import Path
from transformers import AutoTokenizer, AutoModelForCausalLM
from safetensors.torch import load_file
sys.path.insert(0, '.')
from peagle_pipeline.stages.evaluate.prompts import load_prompts
torch.set_num_threads(2)
M='.demo/models/SmolLM2-135M-Instruct'
tok=AutoTokenizer.from_pretrained(M); model=AutoModelForCausalLM.from_pretrained(M, dtype=torch.float32).eval()
t2d=load_file('.quality/runs/main/export/model.safetensors')['t2d']
import inspect; print(inspect.signature(load_prompts))
prompts = load_prompts('mt-bench', M, 80)
tot=inv=0; toks=[]
for i in range(0, len(prompts), 16):
    batch = prompts[i:i+16]
    L=max(map(len,batch))
    ids=torch.tensor([[2]*(L-len(p))+p for p in batch]); att=(torch.arange(L)[None,:]>=torch.tensor([L-len(p) for p in batch])[:,None]).long()
    with torch.no_grad(): out=model.generate(input_ids=ids, attention_mask=att, max_new_tokens=64, do_sample=False, pad_token_id=2)
    gen=out[:, L:]
    for row in gen:
        row=row.tolist()
        if 2 in row: row=row[:row.index(2)+1]
        toks+=row
t=torch.tensor(toks)
print('tokens', len(t), 'in draft vocab', t2d[t].float().mean().item())
import numpy as np, glob
for pat in ['token_counts.npy','all_token_counts.npy']:
    c=sum(np.load(f) for f in glob.glob('.quality/caches/*/**/'+pat, recursive=True))
    order=np.argsort(-c, kind='stable')
    for N in (8192, 12288, 16384, 24576, 32768, 49152):
        keep=torch.zeros(49152, dtype=torch.bool); keep[torch.from_numpy(order[:N].copy())]=True
        print(pat, N, round(keep[t].float().mean().item(),4), 'nonzero counts', int((c>0).sum()))
