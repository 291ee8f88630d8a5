"""messages.py: what crosses between ranks of an inference-rank run (inference_ranks.py's batches, headers and
evaluations): JSON plus raw tensor bytes, never pickle (unpickled bytes could run any code). Imports only torch."""
import json
import math

import torch

# A `table` row (train then eval rows, alike on both sides) travels as its index; an episode's as index + new columns

def encode(obj, table=()):
    """obj (dicts with str keys, lists, tuples, str/int/float/bool/None, tensors, dtypes) -> uint8 tensor: an 8-byte
    length, the JSON, then every tensor's bytes in the order the JSON names them."""
    index, blobs = {id(r): i for i, r in enumerate(table)}, []
    by_prompt = {id(r["prompt"]): i for i, r in enumerate(table) if r.get("prompt") is not None}

    def enc(x):
        if isinstance(x, dict) and id(x) in index:
            return {"__row__": index[id(x)]}
        i = by_prompt.get(id(x.get("prompt"))) if isinstance(x, dict) and x.get("prompt") is not None else None
        if i is not None and all(k in x and x[k] is v for k, v in table[i].items()):  # a row plus columns
            return {"__row__": i, "__extra__": enc({k: v for k, v in x.items() if k not in table[i]})}
        if isinstance(x, torch.Tensor):
            blobs.append(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            return {"__tensor__": str(x.dtype)[6:], "shape": list(x.shape)}
        if isinstance(x, torch.dtype):
            return {"__dtype__": str(x)[6:]}
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise TypeError(f"cross-rank message: dict keys must be strings, got {list(x)[:5]}")
            return {k: enc(v) for k, v in x.items()}
        return [enc(v) for v in x] if isinstance(x, (list, tuple)) else x
    head = json.dumps(enc(obj)).encode()
    data = len(head).to_bytes(8, "little") + head + b"".join(blobs)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _dtype(name):
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"cross-rank message: {name!r} is not a torch dtype")
    return dtype


def decode(data, table=()):
    """The inverse of encode (a uint8 tensor from a peer): only data comes back, never code."""
    raw = data.cpu().numpy().tobytes()
    n = int.from_bytes(raw[:8], "little")
    offset = 8 + n

    def dec(x):
        nonlocal offset
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        if "__row__" in x:
            return {**table[x["__row__"]], **dec(x["__extra__"])} if "__extra__" in x else table[x["__row__"]]
        if "__dtype__" in x:
            return _dtype(x["__dtype__"])
        if "__tensor__" in x:
            dtype, shape = _dtype(x["__tensor__"]), x["shape"]
            size = math.prod(shape) * dtype.itemsize
            chunk, offset = raw[offset:offset + size], offset + size
            flat = torch.frombuffer(bytearray(chunk), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(shape)
        return {k: dec(v) for k, v in x.items()}
    return dec(json.loads(raw[8:8 + n]))
