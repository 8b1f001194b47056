#include "bench/transport/verbs_bench.h"

int main(int argc, char** argv) { return wsync::bench::RunVerbsBench(argc, argv); }
