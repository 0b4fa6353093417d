from agoq.bench.convergence import main

main()
