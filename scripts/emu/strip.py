# scripts/emu.sh's filter: from the preprocessed kernel source (argv), keeps what the host can
# compile with shim.h: drops the __global__ kernels and kernel bodies (extern shared memory),
# every top-level definition with inline asm (PTX) unless shim.h provides that name, and, to a
# fixed point, what calls a dropped function.
import re, sys
src = "".join(open(f).read() + "\n" for f in sys.argv[1:])
out = []; i = 0; n = len(src)
def skip_ws_comments(i):
    return i
# split into top-level chunks: a chunk ends at a ';' or a matching '}' at depth 0 (not inside comments/strings)
chunks = []; start = 0; depth = 0; j = 0
in_c = False; in_lc = False; in_s = False; in_pp = False
while j < n:
    c = src[j]; two = src[j:j+2]
    if in_c:
        if two == "*/": in_c = False; j += 2; continue
        j += 1; continue
    if in_lc:
        if c == "\n": in_lc = False
        j += 1; continue
    if in_pp:
        if c == "\n" and src[j-1] != "\\": in_pp = False; chunks.append(src[start:j+1]); start = j + 1
        j += 1; continue
    if two == "/*": in_c = True; j += 2; continue
    if two == "//": in_lc = True; j += 2; continue
    if c == '"': 
        k = j + 1
        while src[k] != '"': k += 2 if src[k] == "\\" else 1
        j = k + 1; continue
    if c == "#" and depth == 0 and src[start:j].strip() == "": in_pp = True; j += 1; continue
    if c == "{": depth += 1
    elif c == "}":
        depth -= 1
        if depth == 0:
            k = j + 1
            while k < n and src[k] in " \t": k += 1
            if k < n and src[k] == ";": k += 1
            chunks.append(src[start:k]); start = k; j = k; continue
    elif c == ";" and depth == 0:
        chunks.append(src[start:j+1]); start = j + 1
    j += 1
chunks.append(src[start:])
# names the host shim provides (scripts/emu/shim.h): kept available when the source's own
# definitions are dropped
shim = set(re.findall(r"\b(\w+)\s*\(", open(__file__.replace("strip.py", "shim.h")).read()))
def defined_name(body):
    m = re.search(r"(\w+)\s*\([^;{]*\)\s*(?:const\s*)?\{", body)
    return m.group(1) if m else None
bodies = [re.sub(r"/\*.*?\*/", "", ch, flags=re.S) for ch in chunks]
drop = [("__global__" in b or "extern __shared__" in b or re.search(r"\basm\b", b) is not None or "Params_fields" in b) for b in bodies]
# drop what calls a dropped function the shim does not provide, to a fixed point
while True:
    gone = {defined_name(b) for b, d in zip(bodies, drop) if d} - shim - {None}
    changed = False
    for i, b in enumerate(bodies):
        if not drop[i] and any(re.search(r"\b%s\s*[<(]" % re.escape(n), b) for n in gone if n != defined_name(b)):
            drop[i] = changed = True
    if not changed:
        break
for ch, d in zip(chunks, drop):
    out.append("/* [emu: dropped] */\n" if d else ch)
print("".join(out))
