from minimedusa.bench.bench import main

main()
