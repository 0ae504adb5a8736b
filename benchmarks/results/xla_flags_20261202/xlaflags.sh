set -u
so=$(find / -name "xla_cuda_plugin*.so" 2>/dev/null | head -1); echo "plugin: $so"
strings "$so" | grep -o -E "xla_gpu_[a-z0-9_]*(fusion|triton|softmax|norm|block_level|reduction)[a-z0-9_]*" | sort -u > $OUT/r/flags.txt; wc -l $OUT/r/flags.txt
run() { tag=$1; shift; echo "== $tag: $*"; XLA_FLAGS="$*" timeout 150 python3 benchmarks/e2e_decode.py --frameworks jax --cases 'dec B32 D8 r16' --jax-chain 10 --out $OUT/r/$tag > $OUT/r/$tag.log 2>&1; echo rc=$?; grep -E "^\| dec" $OUT/r/$tag/*.md 2>/dev/null | cut -c1-200; tail -2 $OUT/r/$tag.log | cut -c1-300; }
run base ""
for f in xla_gpu_experimental_enable_fusion_block_level_rewriter xla_gpu_enable_triton_softmax_fusion xla_gpu_experimental_enable_triton_softmax_priority_fusion xla_gpu_unsupported_enable_triton_multi_output_fusion; do
  if grep -qx "$f" $OUT/r/flags.txt; then run $f "--$f=true"; else echo "absent: $f"; fi
done
