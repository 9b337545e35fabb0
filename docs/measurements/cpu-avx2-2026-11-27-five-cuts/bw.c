/* Reading rows of a page from memory: 16 MB of slots 384 bytes apart (SmolLM2's 3 KV heads x 64 bf16
 * values), reading `row` bytes of each (128: one KV head's key, as a part of the attention reads it;
 * 384: every KV head's, in address order); with a 5th argument, 64 MB of other data is read first, so
 * that the rows come from memory. Best of 5, GB/s of the bytes read.
 * usage: bw MB stride row [evict] */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
__attribute__((target("avx2"))) int main(int argc,char**argv){
  size_t MB=atoi(argv[1]); int stride=atoi(argv[2]); int row=atoi(argv[3]);
  size_t n=MB<<20; char* b=aligned_alloc(4096,n); memset(b,1,n);
  size_t evn = 64<<20; char* ev = aligned_alloc(4096, evn); memset(ev, 2, evn);
  __m256i acc=_mm256_setzero_si256(); double best=1e9;
  for(int r=0;r<5;r++){
    if (argc>4) for (size_t i=0;i<evn;i+=64) acc=_mm256_add_epi32(acc,_mm256_set1_epi32(ev[i]));
    double t=now();
    for(size_t o=0;o+row<=n;o+=stride) for(int c=0;c<row;c+=32) acc=_mm256_add_epi32(acc,_mm256_loadu_si256((const __m256i*)(b+o+c)));
    t=now()-t; if(t<best)best=t; }
  printf("%zu MB stride %d row %d%s: %.2f GB/s of rows (%d)\n", MB, stride, row, argc>4?" (evicted)":"", (double)(n/stride)*row/best*1e-9, _mm256_extract_epi32(acc,0));
}
