module github.com/nbdmapper/nbdmapper

go 1.26.0
