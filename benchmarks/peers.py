from agoq.bench.peers import main

main()
