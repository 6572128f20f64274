/* Host cost of single CUDA driver calls, and of round trips (launch, completion, poll)
 * made three ways, straight through libcuda (no Python): what the runtime's choices of
 * event flags and completion mechanism rest on (issue 12; results in
 * benchmarks/results/host-polls-2026-11-30.md). Needs a GPU; no CUDA headers:
 *
 *     gcc -O2 -o /tmp/probe_driver_calls benchmarks/probe_driver_calls.c -ldl && /tmp/probe_driver_calls
 *
 * Medians over 20,000 calls. An empty kernel from PTX (sm_90); events created with the
 * flags named; the completion word is mapped pinned host memory.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
typedef int CUresult; typedef void *P;
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
#define S(name, ...) static CUresult (*name)(__VA_ARGS__);
S(cuInit,unsigned) S(cuDeviceGet,int*,int) S(cuDevicePrimaryCtxRetain,P*,int) S(cuCtxSetCurrent,P)
S(cuModuleLoadData,P*,const void*) S(cuModuleGetFunction,P*,P,const char*) S(cuStreamCreate,P*,unsigned)
S(cuEventCreate,P*,unsigned) S(cuLaunchKernel,P,unsigned,unsigned,unsigned,unsigned,unsigned,unsigned,unsigned,P,void**,void**)
S(cuEventRecord,P,P) S(cuEventQuery,P) S(cuStreamWriteValue64,P,uint64_t,uint64_t,unsigned)
S(cuStreamWaitValue64,P,uint64_t,uint64_t,unsigned) S(cuMemHostAlloc,P*,size_t,unsigned)
S(cuMemHostGetDevicePointer,uint64_t*,P,unsigned) S(cuStreamQuery,P) S(cuStreamSynchronize,P) S(cuStreamWaitEvent,P,P,unsigned)
#define L(name, sym) name = dlsym(h, sym); if(!name){printf("no %s\n", sym); return 1;}
#define CK(x) do{int e_=(x); if(e_){printf("%s -> %d\n", #x, e_); return 1;}}while(0)
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
static double med(double*v,int n){qsort(v,n,sizeof *v,cmp);return v[n/2];}
#define N 20000
static double t[N];
int main(void){
  void*h=dlopen("libcuda.so.1",RTLD_NOW); if(!h){printf("no libcuda\n");return 1;}
  L(cuInit,"cuInit") L(cuDeviceGet,"cuDeviceGet") L(cuDevicePrimaryCtxRetain,"cuDevicePrimaryCtxRetain") L(cuCtxSetCurrent,"cuCtxSetCurrent")
  L(cuModuleLoadData,"cuModuleLoadData") L(cuModuleGetFunction,"cuModuleGetFunction") L(cuStreamCreate,"cuStreamCreate")
  L(cuEventCreate,"cuEventCreate") L(cuLaunchKernel,"cuLaunchKernel") L(cuEventRecord,"cuEventRecord") L(cuEventQuery,"cuEventQuery")
  L(cuStreamWriteValue64,"cuStreamWriteValue64_v2") L(cuStreamWaitValue64,"cuStreamWaitValue64_v2") L(cuMemHostAlloc,"cuMemHostAlloc")
  L(cuMemHostGetDevicePointer,"cuMemHostGetDevicePointer_v2") L(cuStreamQuery,"cuStreamQuery") L(cuStreamSynchronize,"cuStreamSynchronize")
  L(cuStreamWaitEvent,"cuStreamWaitEvent")
  int dev; P ctx,mod,f,s,s2,ev,ev2; CK(cuInit(0)); CK(cuDeviceGet(&dev,0)); CK(cuDevicePrimaryCtxRetain(&ctx,dev)); CK(cuCtxSetCurrent(ctx));
  const char*ptx=".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry k()\n{\nret;\n}\n";
  CK(cuModuleLoadData(&mod,ptx)); CK(cuModuleGetFunction(&f,mod,"k"));
  CK(cuStreamCreate(&s,1)); CK(cuStreamCreate(&s2,1)); CK(cuEventCreate(&ev,2|1)); CK(cuEventCreate(&ev2,2|1));
  volatile uint64_t*word; uint64_t dword; CK(cuMemHostAlloc((P*)&word,64,1|2)); /* portable|devicemap */
  CK(cuMemHostGetDevicePointer(&dword,(P)word,0)); word[0]=0;
  for(int i=0;i<2000;i++){CK(cuLaunchKernel(f,1,1,1,32,1,1,0,s,0,0));} CK(cuStreamSynchronize(s));
  // single calls
  #define ONE(label, call, post) for(int i=0;i<N;i++){double a=now(); CK(call); t[i]=now()-a; post;} printf("%-34s %7.3f us\n", label, med(t,N)/1e3);
  ONE("cuLaunchKernel (then sync/100)", cuLaunchKernel(f,1,1,1,32,1,1,0,s,0,0), if(i%100==99) cuStreamSynchronize(s))
  ONE("cuEventRecord", cuEventRecord(ev,s), (void)0)
  CK(cuStreamSynchronize(s));
  ONE("cuEventQuery (done)", cuEventQuery(ev), (void)0)
  uint64_t v=0;
  ONE("cuStreamWriteValue64 (mapped host)", cuStreamWriteValue64(s,dword,++v,0), if(i%100==99) cuStreamSynchronize(s))
  CK(cuStreamSynchronize(s));
  ONE("cuStreamWaitValue64 (satisfied)", cuStreamWaitValue64(s2,dword,1,0), if(i%100==99) cuStreamSynchronize(s2))
  CK(cuStreamSynchronize(s2));
  ONE("cuStreamWaitEvent (done event)", cuStreamWaitEvent(s2,ev,0), if(i%100==99) cuStreamSynchronize(s2))
  ONE("cuStreamQuery (idle)", cuStreamQuery(s), (void)0)
  ONE("cuCtxSetCurrent (same)", cuCtxSetCurrent(ctx), (void)0)
  {P e0,e2,e3; CK(cuEventCreate(&e0,0)); CK(cuEventCreate(&e2,2)); CK(cuEventCreate(&e3,3));
   CK(cuEventRecord(e0,s)); CK(cuEventRecord(e2,s)); CK(cuEventRecord(e3,s)); CK(cuStreamSynchronize(s));
   ONE("cuEventQuery done, flags 0", cuEventQuery(e0), (void)0)
   ONE("cuEventQuery done, flags 2 (no timing)", cuEventQuery(e2), (void)0)
   ONE("cuEventQuery done, flags 3 (+blocking)", cuEventQuery(e3), (void)0)
   int polls; long tot;
   #define RT2(label, enq, done) tot=0; for(int i=0;i<N;i++){double a=now(); enq; polls=0; while(!(done)) polls++; t[i]=now()-a; tot+=polls;} printf("%-34s %7.3f us  (%.1f spins)\n", label, med(t,N)/1e3, (double)tot/N);
   RT2("rt: launch+record(f2), query", (cuLaunchKernel(f,1,1,1,32,1,1,0,s,0,0), cuEventRecord(e2,s)), cuEventQuery(e2)==0)
   RT2("rt: launch+record(f0), query", (cuLaunchKernel(f,1,1,1,32,1,1,0,s,0,0), cuEventRecord(e0,s)), cuEventQuery(e0)==0)
   RT2("rt: launch+record(f3), streamquery", (cuLaunchKernel(f,1,1,1,32,1,1,0,s,0,0), cuEventRecord(e3,s)), cuStreamQuery(s)==0)
   RT2("rt: launch+record(f2), streamquery", (cuLaunchKernel(f,1,1,1,32,1,1,0,s,0,0), cuEventRecord(e2,s)), cuStreamQuery(s)==0)
   /* one query after the work is surely done (as after a trio pass) */
   double u[N];
   for(int i=0;i<N;i++){cuLaunchKernel(f,1,1,1,32,1,1,0,s,0,0); cuEventRecord(e3,s); double w=now(); while(now()-w<15000); double a=now(); int r=cuEventQuery(e3); u[i]=now()-a; if(r){printf("not done %d\n",r);break;}} printf("%-34s %7.3f us\n","first query after 15us, f3", med(u,N)/1e3);
   for(int i=0;i<N;i++){cuLaunchKernel(f,1,1,1,32,1,1,0,s,0,0); cuEventRecord(e2,s); double w=now(); while(now()-w<15000); double a=now(); int r=cuEventQuery(e2); u[i]=now()-a; if(r){printf("not done %d\n",r);break;}} printf("%-34s %7.3f us\n","first query after 15us, f2", med(u,N)/1e3);
   for(int i=0;i<N;i++){cuLaunchKernel(f,1,1,1,32,1,1,0,s,0,0); cuEventRecord(e2,s); double w=now(); while(now()-w<15000); double a=now(); int r=cuStreamQuery(s); u[i]=now()-a; if(r){printf("not done %d\n",r);break;}} printf("%-34s %7.3f us\n","first streamquery after 15us", med(u,N)/1e3);
  }
  // round trips
  int polls; long tot;
  #define RT(label, enq, done) tot=0; for(int i=0;i<N;i++){double a=now(); enq; polls=0; while(!(done)) polls++; t[i]=now()-a; tot+=polls;} printf("%-34s %7.3f us  (%.1f spins)\n", label, med(t,N)/1e3, (double)tot/N);
  RT("rt: launch+record, query", (cuLaunchKernel(f,1,1,1,32,1,1,0,s,0,0), cuEventRecord(ev,s)), cuEventQuery(ev)==0)
  RT("rt: launch+write, read word", (cuLaunchKernel(f,1,1,1,32,1,1,0,s,0,0), cuStreamWriteValue64(s,dword,++v,0)), word[0]>=v)
  RT("rt: launch+record+write, read", (cuLaunchKernel(f,1,1,1,32,1,1,0,s,0,0), cuEventRecord(ev,s), cuStreamWriteValue64(s,dword,++v,0)), word[0]>=v)
  // enqueue-only cost of the two completion styles, 1000 ops then sync
  double a=now(); for(int i=0;i<N;i++){cuLaunchKernel(f,1,1,1,32,1,1,0,s,0,0); cuEventRecord(ev,s);} double b=now(); cuStreamSynchronize(s);
  printf("%-34s %7.3f us/op\n","enqueue launch+record", (b-a)/N/1e3);
  a=now(); for(int i=0;i<N;i++){cuLaunchKernel(f,1,1,1,32,1,1,0,s,0,0); cuStreamWriteValue64(s,dword,++v,0);} b=now(); cuStreamSynchronize(s);
  printf("%-34s %7.3f us/op\n","enqueue launch+write", (b-a)/N/1e3);
  a=now(); for(int i=0;i<N;i++){cuLaunchKernel(f,1,1,1,32,1,1,0,s,0,0);} b=now(); cuStreamSynchronize(s);
  printf("%-34s %7.3f us/op\n","enqueue launch only", (b-a)/N/1e3);
  return 0;
}
