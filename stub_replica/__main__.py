from stub_replica.server import main

main()
